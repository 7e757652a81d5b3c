"""Models of the federated tasks beyond digits: a CNN with BatchNorm, a ResNet, a character LSTM.

Every builder takes the input geometry of its task (channels and side of an image, or the
vocabulary of a character task) and a seed; the initialisation uses a forked RNG, so the global
torch RNG is left untouched. :func:`fedcomp.simulations.task.build_model` picks the builder from
the model name and the task.

=========== ============================================== ================================
name        layers                                         parameters (MNIST 28x28 / chars)
=========== ============================================== ================================
cnn-bn      2 x (conv3x3 - BatchNorm2d - ReLU - maxpool),  421,738
            fc 128 - ReLU - fc classes
resnet      conv3x3 32 - BN, four stride-2 basic blocks    1,229,482
            (32, 64, 128, 256), global avgpool - fc
char-lstm   Embedding(vocab, 64) - LSTM(192) - fc vocab    223,330 (vocab 98)
=========== ============================================== ================================

The image models keep BatchNorm only after convolutions (BatchNorm2d normalises over the
spatial positions too), so a batch of one sample still trains.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CharLSTM", "CnnBn", "ResNet", "count_parameters"]


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (buffers such as BatchNorm statistics excluded)."""
    return sum(p.numel() for p in model.parameters())


class CnnBn(nn.Module):
    """Two conv-BN-ReLU-pool stages and a two-layer classifier head.

    Parameters
    ----------
    channels, side : int
        Input images are ``(channels, side, side)``; ``side`` divisible by 4.
    num_classes : int
    """

    def __init__(self, channels: int, side: int, num_classes: int) -> None:
        super().__init__()
        if side % 4:
            raise ValueError(f"CnnBn needs an image side divisible by 4, got {side}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _BasicBlock(nn.Module):
    """He et al. 2016's basic block: conv3x3-BN-ReLU-conv3x3-BN plus a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: a 3x3 stem and one stride-2 basic block per stage, then global pooling.

    Four stages of widths (32, 64, 128, 256) give 1.2M parameters, while the stride-2 blocks
    keep the compute small (about 14M multiply-adds per 28x28 image) so a few rounds train on
    a CPU.
    """

    def __init__(self, channels: int, num_classes: int, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for w in widths:
            blocks.append(_BasicBlock(cin, w, stride=2))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class CharLSTM(nn.Module):
    """Next-character model: an embedding, one LSTM layer, a linear read-out at every position.

    Input: int64 character ids ``(batch, time)``; output: logits ``(batch, time, vocab)``.
    """

    def __init__(self, vocab: int, embed: int = 64, hidden: int = 192) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h)
