"""``RoundStats``: what one round cost on the wire, and the run's one-line bytes summary."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RoundStats:
    """What one round cost on the wire, summed over the round's clients, and what became of each reply."""

    upload_bytes: int = 0  # train replies as received (Flower message bytes)
    download_bytes: int = 0  # train messages as sent
    upload_bytes_dense: int = 0  # the aggregated replies with the model as plain arrays instead of the payload
    download_bytes_dense: int = 0  # the same train messages with the model as plain arrays
    download_bytes_by_tier: dict[int, int] = dataclasses.field(default_factory=dict)
    encodes: int = 0  # broadcast encodes this round: one per tier with clients, not one per client
    downloads: list[dict] = dataclasses.field(default_factory=list)  # per client: node, tier, mode, steps, bytes
    clients: list[dict] = dataclasses.field(default_factory=list)  # per train reply: node, upload_bytes, status
    links: list[dict] = dataclasses.field(default_factory=list)  # per client with a link: bytes, budget, times
    sim_time_s: float | None = None  # simulated round time (None: no client reported a link)
    aggregated: int = 0  # replies that reached the aggregate
    evaluate_download_bytes: int = 0  # federated-evaluation messages as sent
    evaluate_download_bytes_dense: int = 0  # the same messages with the model as plain arrays
    evaluate_reply_bytes: int = 0  # federated-evaluation replies as received
    evaluate_clients: list[dict] = dataclasses.field(default_factory=list)  # per evaluate message: node, mode, bytes
    extra: list[dict] = dataclasses.field(default_factory=list)  # replies dropped as not answering a message sent

    @property
    def upload_ratio(self) -> float | None:
        """Dense / compressed upload bytes (None when nothing was uploaded: never NaN)."""
        return self.upload_bytes_dense / self.upload_bytes if self.upload_bytes and self.upload_bytes_dense else None

    @property
    def download_ratio(self) -> float | None:
        return self.download_bytes_dense / self.download_bytes if self.download_bytes else None


def _ratio(dense: int, sent: int) -> str:
    return f"{dense / sent:.1f}x fewer than dense" if sent and dense else "no dense reference"


def bytes_summary(rounds: dict[int, RoundStats]) -> str:
    """One line for the end of a run: rounds, what became of the replies, train bytes up and down
    against the same messages with dense models. ``dropped`` counts replies that arrived but did not
    reach the aggregate (errors, checks, resyncs, late); ``missing`` messages that got no reply."""
    stats = list(rounds.values())
    aggregated = sum(s.aggregated for s in stats)
    missing = sum(1 for s in stats for c in s.clients if c.get("status", "").startswith("no reply"))
    dropped = sum(len(s.clients) + len(s.extra) for s in stats) - aggregated - missing
    up, up_dense = sum(s.upload_bytes for s in stats), sum(s.upload_bytes_dense for s in stats)
    down, down_dense = sum(s.download_bytes for s in stats), sum(s.download_bytes_dense for s in stats)
    return (f"fedcomp: {len(stats)} rounds | replies: {aggregated} aggregated, {dropped} dropped, {missing} missing"
            f" | upload {up:,} B ({_ratio(up_dense, up)}) | download {down:,} B ({_ratio(down_dense, down)})")
