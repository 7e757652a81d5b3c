"""Model, data and training of the deployment example: scikit-learn's bundled digits (no download)."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP (64 -> 128 -> 10), the same weights for the same seed on every node."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def load_data(partition_id: int, num_partitions: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """This node's training share (every num_partitions-th example of the first 80%) and the test set."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    split = int(0.8 * len(y))
    train = (x[partition_id:split:num_partitions], y[partition_id:split:num_partitions])
    return train, (x[split:], y[split:])


def train(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], epochs: int, lr: float, seed: int) -> float:
    """Plain SGD over ``data`` in batches of 32; returns the last batch's loss."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
    return float(loss)


@torch.no_grad()
def test(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(loss, accuracy) on ``data``."""
    x, y = data
    model.eval()
    logits = model(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
