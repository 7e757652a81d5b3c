"""Models of the federated tasks beyond digits: a CNN with BatchNorm, a ResNet, a character LSTM
and a small decoder-only transformer.

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
char-       token + learned position embeddings (132),     1,052,389 (vocab 98)
transformer 5 pre-LayerNorm blocks (causal self-attention,
            4 heads; MLP 499, GELU), LayerNorm, fc vocab
=========== ============================================== ================================

The image models keep BatchNorm only after convolutions (BatchNorm2d normalises over the
spatial positions too), so a batch of one sample still trains.

The transformer's widths are deliberately not all multiples of 16 (vocabulary 98, model width 132,
MLP width 499), so the codecs see the uneven layouts users' models have. Its training cost per
character grows with its parameters, about five times the LSTM's: on a shared CPU core it trains a
bounded number of windows per local epoch (:attr:`CharTransformer.local_examples`) and is scored on
an evenly spaced part of the test windows (:attr:`CharTransformer.eval_examples`); see
:func:`fedcomp.simulations.task.train` and :func:`~fedcomp.simulations.task.evaluate`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CharLSTM", "CharTransformer", "CnnBn", "ResNet", "count_parameters"]


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


class _DecoderBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, causal attention by
    :func:`torch.nn.functional.scaled_dot_product_attention` (``is_causal=True``)."""

    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp)
        self.out = nn.Linear(mlp, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d / heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Decoder-only next-character model (GPT-style): token and learned position embeddings,
    pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and a
    linear read-out.

    Input: int64 character ids ``(batch, time)`` with ``time <= context``; output: logits
    ``(batch, time, vocab)``, position ``t`` depending on inputs ``0..t`` only.

    Trained by plain SGD (the project's clients), not Adam, so the read-out is scaled for it: its
    logits are divided by ``sqrt(width)`` and it starts at zero (the first loss is ``log(vocab)``).
    Unscaled, one SGD step moves the logits by about ``lr * width`` (the final LayerNorm's output
    has unit scale per coordinate), and a read-out tied to the embedding then swings between
    unigram guesses at any rate that trains the blocks. The blocks are initialised as GPT-2's
    (normal weights of std 0.02, residual projections by ``1 / sqrt(2 * layers)``, zero biases),
    the embeddings as torch's (std 1).
    """

    #: Windows trained per local epoch (a seeded draw from the epoch's shuffle; all when fewer).
    local_examples: int = 64
    #: Test windows scored by ``evaluate`` (evenly spaced over the ones given; all when fewer).
    eval_examples: int = 250

    def __init__(self, vocab: int, context: int = 80, width: int = 132, layers: int = 5, heads: int = 4,
                 mlp: int = 499) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"CharTransformer needs width divisible by heads, got width={width}, heads={heads}")
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_DecoderBlock(width, heads, mlp) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for name, p in self.blocks.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"CharTransformer takes at most {self.context} positions, got {t}")
        h = self.embed(x) + self.position.weight[:t]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)) / math.sqrt(h.shape[-1])
