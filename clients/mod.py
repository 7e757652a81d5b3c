"""``compression_mod``: a Flower client mod that decodes compressed broadcasts and compresses replies.

It works with any ClientApp whose train reply carries one ArrayRecord (the trained model):

1. The broadcast moves the reference model kept in ``Context.state`` (a chain of compressed
   steps, or the full reference: :mod:`fedcomp.broadcast`); the reference is handed to the app
   as the ArrayRecord it expects (under the strategy's original record name). If the
   reference cannot be rebuilt exactly (state lost, CRC mismatch) the mod replies with a
   resync request instead of training, and the server sends the full model next time.
2. The app trains and replies with its model.
3. The mod computes the update ``delta = trained - received``, adds the residual kept in
   ``Context.state`` (error feedback), encodes it with the codec the server asked for, keeps
   the new residual, and replaces the reply's ArrayRecord with the payload, the reference it
   holds (tier, version, CRC) and the tier it wants.

Bandwidth budgets (:mod:`fedcomp.clients.budgeting`): when the node has a link (node config
``uplink-kbps``/``downlink-kbps``/... or ``link=<preset>``, else the run's ``link-profile`` for its
``partition-id``), its downlink picks the download tier, step 3 encodes with the codec whose free
parameter makes the whole reply fit the link's budget (byte cap, or what the uplink carries in the
time the round deadline leaves), and the reply reports the concrete spec, link, budget, status,
the broadcast bytes it received and the measured seconds of decode + training + encode. The
encode's own time is not known before the fit: the budget reserves the longest of the node's
recent encodes (x1.5). Without a link (profile 'none', no link keys) nothing of this happens.

Messages without a fedcomp record (evaluation, or a strategy that is not wrapped) pass through.
"""

from __future__ import annotations

from time import perf_counter

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

import fedcomp
from fedcomp import protocol as P
from fedcomp.broadcast import ResyncNeeded, apply_plan, parse_thresholds, tier_for_kbps
from fedcomp.clients.budgeting import budgeted_upload, reply_bytes
from fedcomp import links

ENCODE_HISTORY = 5  # recent encode times kept; the budget reserves the longest of them (x ENCODE_MARGIN)
ENCODE_MARGIN = 1.5


def _torch_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())


def node_device(context: Context) -> torch.device:
    """The node's device: node config ``device`` if given, else CUDA when present, else CPU."""
    wanted = str(context.node_config.get("device", "cuda" if torch.cuda.is_available() else "cpu"))
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(wanted)


def desired_tier(context: Context, tiers: int, thresholds: str, link: links.Link | None = None) -> int:
    """The download tier this node belongs in: node config ``download-tier``, else its downlink
    kbps (node config ``downlink-kbps``, else its ``link``'s) against the server's thresholds,
    else ``partition-id`` modulo the number of tiers (simulated nodes know nothing else), else 0."""
    config = context.node_config
    if "download-tier" in config:
        tier = config["download-tier"]
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < tiers:
            raise RuntimeError(f"node config download-tier={tier!r} is invalid: it must be an integer in [0, {tiers - 1}]")
        return tier
    limits = parse_thresholds(thresholds, tiers) if thresholds else ()
    if limits and "downlink-kbps" in config:
        return tier_for_kbps(float(config["downlink-kbps"]), limits)
    if limits and link is not None:
        return tier_for_kbps(link.downlink_kbps, limits)
    if "partition-id" in config:
        return int(config["partition-id"]) % tiers
    return 0


def node_link(context: Context, cfg) -> links.Link | None:
    """This node's link: node-config link keys first (``uplink-kbps`` or ``link=<preset>``; a
    ``downlink-kbps`` alone only picks the download tier), else the run's link profile (sent in
    the broadcast) for its partition; the run's round deadline where the link has none. None: no link."""
    profile = str(cfg.get(P.LINK_PROFILE, links.NONE))
    config = context.node_config
    if "link" not in config and "uplink-kbps" not in config:
        # downlink-kbps alone only picks the download tier (no uplink: no link, no budget)
        config = {k: v for k, v in config.items() if k not in ("downlink-kbps", "latency-ms")}
    try:
        link = links.resolve_link(config, profile, seed=int(cfg[P.SEED]))
    except links.LinkError as exc:
        raise RuntimeError(f"fedcomp could not resolve this node's link: {exc}") from exc
    if link is None:
        return None
    deadline = float(cfg.get(P.DEADLINE, 0.0))
    return links.with_deadline(link, deadline if deadline > 0 else None)


def _held_reference(context: Context) -> tuple[dict[str, torch.Tensor] | None, tuple[int, int, int] | None]:
    if P.REF_STATE not in context.state.array_records or P.REF_INFO_STATE not in context.state.config_records:
        return None, None
    info = context.state.config_records[P.REF_INFO_STATE]
    return _torch_dict(context.state.array_records[P.REF_STATE]), (
        int(info[P.TIER]), int(info[P.REF_VERSION]), int(info[P.REF_CRC]))


def _forget(context: Context, *keys: str) -> None:
    for key in keys:
        if key in context.state:
            del context.state[key]


def _return_unacknowledged(context: Context, cfg, residual, use_ef: bool):
    """Nothing lost: if the update sent last time never reached the aggregate (dropped as
    corrupt, late, or its reply lost), the server's ack says so and it goes back into the
    residual, to be sent again. An acknowledged one is simply forgotten."""
    if P.PENDING_INFO_STATE not in context.state.config_records:
        return residual
    sent_round = int(context.state.config_records[P.PENDING_INFO_STATE]["round"])
    pending = _torch_dict(context.state.array_records[P.PENDING_STATE]) if P.PENDING_STATE in context.state else {}
    _forget(context, P.PENDING_STATE, P.PENDING_INFO_STATE)
    ack = int(cfg.get(P.ACK_ROUND, sent_round))  # a server that does not ack: assume it arrived
    if ack >= sent_round or not use_ef:
        return residual
    residual = dict(residual or {})
    for name, update in pending.items():
        if name in residual and residual[name].shape == update.shape:
            residual[name] = residual[name] + update.to(residual[name].dtype)
        else:
            residual[name] = update.clone()
    return residual


def _keep_pending(context: Context, cfg, encoded, server_round: int, use_ef: bool, beta: float) -> None:
    """Remember what this reply carries until the server acknowledges it (error feedback on, no
    delta coding: with delta coding a dropped reply already restarts the reference)."""
    if not use_ef or beta > 0 or P.ACK_ROUND not in cfg:
        return
    context.state[P.PENDING_STATE] = ArrayRecord(
        {k: v.detach().cpu() for k, v in encoded.decoded.items() if v.is_floating_point()})
    context.state[P.PENDING_INFO_STATE] = ConfigRecord({"round": server_round})


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: decode the compressed broadcast, compress the reply (see module docstring)."""
    if not msg.has_content() or P.DOWNLOAD_RECORD not in msg.content.config_records:
        return call_next(msg, context)
    start = perf_counter()  # compute time: decode + training + encode (what the client does)
    cfg = msg.content.config_records[P.DOWNLOAD_RECORD]
    link = node_link(context, cfg)
    download_seen = reply_bytes(msg.content) if link is not None else 0
    want = desired_tier(context, int(cfg[P.TIERS]), str(cfg[P.TIER_KBPS]), link)
    try:
        layout = fedcomp.Layout.from_json(str(cfg[P.LAYOUT]))
        upload = fedcomp.build_codec(str(cfg[P.UPLOAD_SPEC]))
    except fedcomp.FedcompError as exc:
        raise RuntimeError(f"fedcomp could not read the broadcast: {exc}") from exc
    held, held_info = _held_reference(context)
    try:
        received, info = apply_plan(
            held, held_info, mode=str(cfg[P.MODE]), tier=int(cfg[P.TIER]), spec=str(cfg[P.DOWNLOAD_SPEC]),
            payloads=[bytes(p) for p in cfg[P.PAYLOADS]], rounds=[int(r) for r in cfg[P.ROUNDS]],
            base_crc=int(cfg[P.BASE_CRC]), crc=int(cfg[P.REF_CRC]), layout=layout,
        )
    except fedcomp.FedcompError as exc:  # ResyncNeeded, or a step that does not decode
        _forget(context, P.REF_STATE, P.REF_INFO_STATE)
        reason = str(exc) if isinstance(exc, ResyncNeeded) else f"broadcast did not decode: {exc}"
        record = {P.RESYNC: reason, P.WANT_TIER: want}
        if link is not None:  # no training, but the round still cost this node its download
            record.update({P.LINK: link.describe(), P.BUDGET: -1, P.DOWNLOAD_SEEN: download_seen,
                           P.COMPUTE_S: float(perf_counter() - start)})
        return Message(RecordDict({P.UPLOAD_RECORD: ConfigRecord(record)}), reply_to=msg)
    context.state[P.REF_STATE] = ArrayRecord(received)
    context.state[P.REF_INFO_STATE] = ConfigRecord({P.TIER: info[0], P.REF_VERSION: info[1], P.REF_CRC: info[2]})

    arrays_key = str(cfg[P.ARRAYS_KEY])
    inner = RecordDict({k: v for k, v in msg.content.items() if k != P.DOWNLOAD_RECORD})
    inner[arrays_key] = ArrayRecord(received)
    msg.content = inner
    reply = call_next(msg, context)
    if reply.has_error():
        return reply

    array_keys = list(reply.content.array_records)
    if len(array_keys) != 1:
        raise RuntimeError(
            f"compression_mod needs a train reply with exactly one ArrayRecord, got {len(array_keys)}: {array_keys}"
        )
    trained = _torch_dict(reply.content.array_records[array_keys[0]])
    try:
        layout.check(trained)
    except fedcomp.SpecError as exc:  # a client with another model: say so instead of a shape error
        return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, f"fedcomp: the trained model does not match "
                             f"the server's layout: {exc}"), reply_to=msg)
    device = node_device(context)
    delta = {name: trained[name].to(device) - received[name].to(device) for name in layout.names}

    use_ef = bool(cfg[P.ERROR_FEEDBACK])
    residual = _torch_dict(context.state.array_records[P.RESIDUAL_STATE]) if (
        use_ef and P.RESIDUAL_STATE in context.state.array_records
    ) else None
    residual = _return_unacknowledged(context, cfg, residual, use_ef)
    # delta coding: encode update - beta * (what the server reconstructed from our last reply),
    # only when the server holds that same reference (else send the plain update: a resync)
    beta = float(cfg.get(P.DELTA, 0.0))
    ref = 0
    last_sent: dict[str, torch.Tensor] = {}
    if beta > 0 and P.LAST_SENT_STATE in context.state.array_records:
        last_round = int(context.state.config_records[P.LAST_ROUND_STATE]["round"])
        if last_round != 0 and last_round == int(cfg.get(P.DELTA_REF, 0)):
            ref = last_round
            last_sent = {k: v.to(device) for k, v in _torch_dict(context.state.array_records[P.LAST_SENT_STATE]).items()}
            delta = {k: v - beta * last_sent[k] if k in last_sent else v for k, v in delta.items()}
    state = _torch_dict(context.state.array_records[P.CODEC_STATE]) if P.CODEC_STATE in context.state.array_records else {}
    state = {k: v.to(device) for k, v in state.items()}
    server_round = int(cfg[P.ROUND])
    # the partition id where the node has one: node ids are random per simulation run, and the
    # nonce (stochastic rounding, random-k) must not be, for seeded runs to repeat bit for bit
    ident = int(context.node_config.get("partition-id", context.node_id))
    nonce = fedcomp.derive_nonce(int(cfg[P.SEED]), server_round, ident)
    rest = RecordDict({k: v for k, v in reply.content.items() if k != array_keys[0]})
    record = {P.ARRAYS_KEY: array_keys[0], P.DELTA_REF: ref, P.TIER: info[0], P.REF_VERSION: info[1],
              P.REF_CRC: info[2], P.WANT_TIER: want}
    if link is not None:
        reply.content = _budgeted_reply(
            context, cfg, upload.spec, link, delta, residual, state, rest, record, nonce=nonce,
            server_round=server_round, use_ef=use_ef, beta=beta, last_sent=last_sent,
            download_seen=download_seen, start=start)
        return reply
    encoded, new_residual = fedcomp.compress(
        upload, delta, residual, nonce=nonce, error_feedback=use_ef, round=server_round, state=state
    )
    if new_residual:
        context.state[P.RESIDUAL_STATE] = ArrayRecord({k: v.cpu() for k, v in new_residual.items()})
    if state:
        context.state[P.CODEC_STATE] = ArrayRecord({k: v.cpu() for k, v in state.items()})

    if beta > 0:
        sent = {k: v + beta * last_sent[k] if k in last_sent else v
                for k, v in encoded.decoded.items() if v.is_floating_point()}
        context.state[P.LAST_SENT_STATE] = ArrayRecord({k: v.cpu() for k, v in sent.items()})
        context.state[P.LAST_ROUND_STATE] = ConfigRecord({"round": server_round})
    _keep_pending(context, cfg, encoded, server_round, use_ef and bool(new_residual), beta)

    rest[P.UPLOAD_RECORD] = ConfigRecord({P.PAYLOAD: encoded.payload, **record})
    reply.content = rest
    return reply


def _budgeted_reply(context, cfg, spec, link, delta, residual, state, rest, record, *, nonce, server_round,
                    use_ef, beta, last_sent, download_seen, start) -> RecordDict:
    """Step 3 for a node with a link: the reply whose whole size fits the link's budget."""
    encode_start = perf_counter()
    compute_s = encode_start - start  # decode + training
    history = [float(v) for v in context.state.config_records[P.ENCODE_STATE]["s"]] if (
        P.ENCODE_STATE in context.state.config_records) else []
    # this round's encode time is not known yet: reserve 1.5x the longest recent one (first round:
    # as long as decode + training took) so a noisy encode does not push the node past its deadline
    reserve = ENCODE_MARGIN * max(history) if history else compute_s

    def build(payload: bytes, used: str) -> RecordDict:
        content = RecordDict(dict(rest.items()))
        # COMPUTE_S is a float (fixed 8 bytes on the wire): overwritten below at the same size
        content[P.UPLOAD_RECORD] = ConfigRecord({
            P.PAYLOAD: payload, **record, P.SPEC: used, P.LINK: link.describe(), P.BUDGET: budget_value,
            P.COMPUTE_S: 0.0, P.DOWNLOAD_SEEN: download_seen,
        })
        return content

    budget = links.upload_budget(link, download_seen, compute_s + reserve)
    budget_value = -1 if budget is None else int(budget)
    try:
        result = budgeted_upload(
            spec, delta, residual, link=link, download_bytes=download_seen, compute_s=compute_s + reserve,
            build=build, nonce=nonce, round=server_round, state=state, error_feedback=use_ef,
            fallback=str(cfg.get(P.FALLBACK, "skip")),
        )
    except fedcomp.SpecError as exc:  # a codec without a free parameter, a bad fallback
        raise RuntimeError(f"fedcomp could not fit the upload to this node's budget: {exc}") from exc
    if use_ef and result.residual:
        context.state[P.RESIDUAL_STATE] = ArrayRecord({k: v.detach().cpu() for k, v in result.residual.items()})
    if result.state:
        context.state[P.CODEC_STATE] = ArrayRecord({k: v.cpu() for k, v in result.state.items()})
    if result.encoded is not None and beta > 0:
        sent = {k: v + beta * last_sent[k] if k in last_sent else v
                for k, v in result.encoded.decoded.items() if v.is_floating_point()}
        context.state[P.LAST_SENT_STATE] = ArrayRecord({k: v.cpu() for k, v in sent.items()})
        context.state[P.LAST_ROUND_STATE] = ConfigRecord({"round": server_round})
    if result.encoded is not None:
        _keep_pending(context, cfg, result.encoded, server_round, use_ef and bool(result.residual), beta)
    encode_s = perf_counter() - encode_start  # the fit's search included: the client pays for it
    context.state[P.ENCODE_STATE] = ConfigRecord({"s": (history + [encode_s])[-ENCODE_HISTORY:]})
    if result.content is None:  # skipped: no payload, the update stays in the residual
        content = RecordDict(dict(rest.items()))
        content[P.UPLOAD_RECORD] = ConfigRecord({
            **record, P.SPEC: result.spec, P.LINK: link.describe(), P.BUDGET: budget_value,
            P.BUDGET_STATUS: result.status, P.BUDGET_REASON: str(result.info.get("reason", "")),
            P.COMPUTE_S: 0.0, P.DOWNLOAD_SEEN: download_seen,
        })
    else:
        content = result.content
        if result.status == "too-small-coarsest":  # over budget anyway: say so (fits report nothing extra)
            content[P.UPLOAD_RECORD][P.BUDGET_STATUS] = result.status
            content[P.UPLOAD_RECORD][P.BUDGET_REASON] = str(result.info.get("reason", ""))
    content[P.UPLOAD_RECORD][P.COMPUTE_S] = float(compute_s + encode_s)
    return content
