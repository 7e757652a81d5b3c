"""Where delta coding of uploads pays: ``python -m fedcomp.simulations.delta_study``.

1. How alike consecutive round updates of a digits client are (cosine similarity), in plain
   10-client FedAvg with the default run config (the one experiment harness,
   :mod:`fedcomp.simulations.harness`).
2. Relative error of the summed update after 12 rounds of drifting updates (a fixed direction
   plus small noise), per codec, with delta 0 / 0.5 / 1, through the client mod and the strategy
   wrapper themselves (``CompressedStrategy(delta=beta)``): the client encodes ``u - beta * r_prev``
   with error feedback and the server reconstructs ``r = decoded + beta * r_prev``.
"""

from __future__ import annotations

import torch



def consecutive_cosines(rounds: int = 30, clients: int = 10, seed: int = 0) -> list[tuple[int, float]]:
    """Every 5th round: the mean over clients of cosine(update_t, update_t-1), in dense FedAvg run
    through :func:`fedcomp.simulations.harness.run` (a mod around the ClientApp reads each update)."""
    from fedcomp.simulations import harness

    updates: dict[int, dict[int, torch.Tensor]] = {}

    def record(msg, context, call_next):
        reply = call_next(msg, context)
        sent = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = reply.content.array_records["arrays"].to_torch_state_dict()
        rnd = int(msg.content.config_records["config"]["server-round"])
        updates.setdefault(rnd, {})[context.node_id] = torch.cat(
            [(trained[k].float() - sent[k].float()).reshape(-1) for k in sent])
        return reply

    harness.run(harness.DENSE, rounds=rounds, clients=clients, seed=seed, mods=[record])
    out = []
    for r in range(5, rounds + 1, 5):
        cos = [float(torch.nn.functional.cosine_similarity(u, updates[r - 1][n], dim=0))
               for n, u in updates[r].items() if n in updates.get(r - 1, {})]
        out.append((r, sum(cos) / len(cos)))
    return out


def delta_error(spec: str, beta: float, error_feedback: bool, rounds: int = 12, seed: int = 0) -> float:
    """Relative error of what the server applied against the sum of one client's drifting updates,
    through the real mod and wrapper (``CompressedStrategy(delta=beta)``, ``Strategy.start`` on the
    harness's :class:`~fedcomp.simulations.harness.InProcessGrid`, one node, dense broadcasts)."""
    import logging

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.clients.mod import compression_mod
    from fedcomp.simulations import harness
    from fedcomp.strategies import CompressedStrategy

    g = torch.Generator().manual_seed(seed)
    base = {"w": 0.05 * torch.randn(64, 32, generator=g), "b": 0.05 * torch.randn(64, generator=g)}
    updates = [{k: v + 0.002 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(rounds)]

    def app(msg, context):  # the client's training: this round's update
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        step = updates[int(msg.content.config_records["config"]["server-round"]) - 1]
        return Message(RecordDict({"arrays": ArrayRecord({k: received[k] + step[k] for k in received}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    harness._identity()
    contexts = {1: Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})}
    grid = harness.InProcessGrid(app, contexts, mods=[compression_mod])
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1,
                                         min_train_nodes=1), upload=spec, download="none()", delta=beta,
                                  error_feedback=error_feedback, seed=seed)
    start = {k: torch.zeros_like(v) for k, v in base.items()}
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(start), num_rounds=rounds)
    finally:
        flwr_log.setLevel(level)
    applied = result.arrays.to_torch_state_dict()["w"] - start["w"]
    total = sum(u["w"] for u in updates)
    return float((applied - total).norm() / total.norm())


def main() -> None:
    for r, cos in consecutive_cosines():
        print(f"round {r:2d}: mean cosine(update_t, update_t-1) over clients = {cos:.3f}")
    print("\n| upload | error feedback | delta 0 | delta 0.5 | delta 1 |\n|---|---|---|---|---|")
    for spec, ef in [("kbit(bits=2,block=64)", True), ("sign(block=64)", True), ("topk(ratio=0.05)", False),
                     ("topk(ratio=0.05)", True), ("qsgd(bits=2,bucket=64)", True)]:
        errors = " | ".join(f"{delta_error(spec, beta, ef):.3f}" for beta in (0.0, 0.5, 1.0))
        print(f"| `{spec}` | {'on' if ef else 'off'} | {errors} |")


if __name__ == "__main__":
    main()
