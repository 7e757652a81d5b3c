"""Where delta coding of uploads pays: ``python -m fedcomp.simulations.delta_study``.

1. How alike consecutive round updates of a digits client are (cosine similarity), in plain
   10-client FedAvg with the default run config.
2. Relative error of the summed update after 12 rounds of drifting updates (a fixed direction
   plus small noise), per codec, with delta 0 / 0.5 / 1, the same arithmetic as the client mod
   and the strategy wrapper: the client encodes ``u - beta * r_prev`` with error feedback and the
   server reconstructs ``r = decoded + beta * r_prev``.
"""

from __future__ import annotations

import copy

import torch

import fedcomp
from fedcomp.simulations import task


def consecutive_cosines(rounds: int = 30, clients: int = 10, seed: int = 0) -> list[tuple[int, float]]:
    train_set, _ = task.load_digits_split(seed=seed)
    model = task.build_model("mlp", seed)
    parts = [task.partition(train_set, clients, i, 0.5, seed) for i in range(clients)]
    previous, out = None, []
    for r in range(1, rounds + 1):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        deltas = []
        for i, (x, y) in enumerate(parts):
            local = copy.deepcopy(model)
            task.train(local, x, y, epochs=1, lr=0.3, batch_size=32, seed=r * 1009 + i, device="cpu")
            deltas.append(torch.cat([(local.state_dict()[k] - start[k]).reshape(-1) for k in start]))
        if previous is not None and r % 5 == 0:
            cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(deltas, previous)]
            out.append((r, sum(cos) / len(cos)))
        previous = deltas
        mean = sum(deltas) / len(deltas)
        offset, new = 0, {}
        for k, v in start.items():
            new[k] = v + mean[offset:offset + v.numel()].view(v.shape)
            offset += v.numel()
        model.load_state_dict(new)
    return out


def delta_error(spec: str, beta: float, error_feedback: bool, rounds: int = 12, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    base = {"w": 0.05 * torch.randn(64, 32, generator=g), "b": 0.05 * torch.randn(64, generator=g)}
    codec = fedcomp.build_codec(spec)
    residual, reference, total, applied = None, None, None, None
    for r in range(1, rounds + 1):
        update = {k: v + 0.002 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        target = update if reference is None else {k: update[k] - beta * reference[k] for k in update}
        enc, residual = fedcomp.compress(codec, target, residual, nonce=r, round=r, error_feedback=error_feedback)
        reference = enc.decoded if reference is None else {k: enc.decoded[k] + beta * reference[k] for k in update}
        total = update if total is None else {k: total[k] + update[k] for k in update}
        applied = reference if applied is None else {k: applied[k] + reference[k] for k in update}
    return float((applied["w"] - total["w"]).norm() / total["w"].norm())


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
