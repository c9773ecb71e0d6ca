"""Random models, to fuzz the engine and the planner with architectures nobody
wrote a test for: stacks of blocks of several kinds (MLPs with dropout and
normalisation, residual CNNs with BatchNorm (blocks that are one layer, or a
layer per step with the skip passed along the chain), pre-norm transformers, language
models whose head is tied to the embedding), with a minibatch and a loss.
The same seed gives the same model, weights and data."""

from __future__ import annotations

import random

import torch
from torch import nn


class _Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class _Fork(nn.Module):
    """Opens a residual block whose layers are layers of the chain: the tensor goes
    on twice, as the main path and the skip, ``(h, skip)``."""

    def forward(self, x):
        return x, x


class _ConvBN(nn.Module):
    """One conv-BatchNorm(-ReLU) of a block's main path; the skip passes by unchanged."""

    def __init__(self, c: int, relu: bool):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = relu

    def forward(self, h, skip):
        h = self.norm(self.conv(h))
        return (torch.relu(h) if self.relu else h), skip


class _Join(nn.Module):
    """Closes the block: ReLU of the main path plus the skip, the skip through a
    1x1 conv-BatchNorm where ``project`` (a ResNet's projection shortcut)."""

    def __init__(self, c: int, project: bool):
        super().__init__()
        self.project = (
            nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)) if project else None
        )

    def forward(self, h, skip):
        return torch.relu(h + (skip if self.project is None else self.project(skip)))


def _cnn_block(rng: random.Random, c: int) -> list[nn.Module]:
    """A residual block: one layer (conv-BN-ReLU-conv and the identity), or a
    layer per step, the skip passed along the chain beside the main path, so
    that it crosses the packs' boundaries."""
    if rng.random() < 0.5:
        return [
            _Residual(
                nn.Sequential(
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c),
                    nn.ReLU(),
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                )
            )
        ]
    steps = [_ConvBN(c, relu=rng.random() < 0.5) for _ in range(rng.randint(1, 3))]
    return [_Fork(), *steps, _Join(c, project=rng.random() < 0.5)]


class _Attention(nn.Module):
    """Pre-norm causal self-attention with a residual connection."""

    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.heads, self.p = heads, p
        self.norm, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.norm(x))
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        a = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0
        )
        return x + self.out(a.transpose(1, 2).reshape(b, t, d))


class _TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm = nn.LayerNorm(embedding.embedding_dim)
        self.embedding = embedding

    def forward(self, x):
        return self.norm(x) @ self.embedding.weight.t()


def _token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def random_model(seed: int, minibatch: int):
    """``(model, inputs, target, loss_fn)``: a random ``nn.Sequential`` of one of
    four kinds, a minibatch for it and its loss."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    kind = rng.choice(["mlp", "cnn", "transformer", "tied-lm"])
    depth = rng.randint(2, 5)
    p = rng.choice([0.0, 0.0, 0.1, 0.3])
    if kind == "mlp":
        d = rng.choice([16, 32, 64, 96])
        layers: list[nn.Module] = [nn.Linear(12, d)]
        for _ in range(depth):
            norm = rng.choice([nn.LayerNorm(d), nn.BatchNorm1d(d), nn.Identity()])
            act = rng.choice([nn.ReLU(), nn.GELU(), nn.Tanh()])
            block = nn.Sequential(nn.Linear(d, d), norm, act, nn.Dropout(p))
            layers.append(_Residual(block) if rng.random() < 0.5 else block)
        layers.append(nn.Linear(d, 7))
        return (
            nn.Sequential(*layers),
            (torch.randn(minibatch, 12, generator=g),),
            torch.randint(0, 7, (minibatch,), generator=g),
            nn.functional.cross_entropy,
        )
    if kind == "cnn":
        c = rng.choice([4, 8, 12])
        layers = [nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
        for i in range(depth):
            layers += _cnn_block(rng, c)
            if i == depth // 2:
                layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(p), nn.Linear(c, 10)]
        return (
            nn.Sequential(*layers),
            (torch.randn(minibatch, 3, 8, 8, generator=g),),
            torch.randint(0, 10, (minibatch,), generator=g),
            nn.functional.cross_entropy,
        )
    vocab, seq, d = rng.choice([32, 64]), rng.choice([4, 8, 12]), rng.choice([16, 32, 48])
    embedding = nn.Embedding(vocab, d)
    blocks = []
    for _ in range(depth):
        blocks.append(_Attention(d, rng.choice([2, 4]), p))
        blocks.append(
            _Residual(
                nn.Sequential(
                    nn.LayerNorm(d),
                    nn.Linear(d, 2 * d),
                    nn.GELU(),
                    nn.Linear(2 * d, d),
                    nn.Dropout(p),
                )
            )
        )
    head = (
        _TiedHead(embedding)
        if kind == "tied-lm"
        else nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))
    )
    ids = torch.randint(0, vocab, (minibatch, seq), generator=g)
    return nn.Sequential(embedding, *blocks, head), (ids,), torch.roll(ids, -1, 1), _token_loss
