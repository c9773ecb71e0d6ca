"""Small models of kinds the engine's own tests were not written around: a CNN
with BatchNorm and residual blocks, a Llama-style decoder (RMSNorm, rotary
attention, SwiGLU), a BERT-style encoder with and without a head tied to the
embedding, and an MLP with dropout. Each comes with a loss and a minibatch
maker; all are deterministic given ``torch.manual_seed``."""

from __future__ import annotations

import torch
from torch import nn

import harmony

VOCAB, SEQ = 48, 8


class ConvBNBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (a ResNet basic block)."""

    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        ConvBNBlock(8),
        ConvBNBlock(8),
        nn.MaxPool2d(2),
        ConvBNBlock(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    """Pre-norm block: causal attention with rotary positions, then a SwiGLU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        half = d // self.heads // 2
        angle = torch.outer(
            torch.arange(t, dtype=x.dtype), 1e4 ** -(torch.arange(half, dtype=x.dtype) / half)
        )
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)

        def rotate(z):
            z1, z2 = z.chunk(2, -1)
            return z * cos + torch.cat([-z2, z1], -1) * sin

        a = nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class LlamaHead(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.proj = RMSNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def llama(d: int = 32, heads: int = 4, blocks: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Embedding(VOCAB, d), *[LlamaBlock(d, heads) for _ in range(blocks)], LlamaHead(d)
    )


class BertEmbed(nn.Module):
    """Token + position embeddings, LayerNorm, dropout; passes the padding mask on."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.norm, self.drop = nn.LayerNorm(d), nn.Dropout(p)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.drop(self.norm(x)), mask


class BertLayer(nn.Module):
    """Post-norm encoder layer; the additive mask hides padding."""

    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p)
        )

    def forward(self, x, mask):
        x = self.norm1(x + self.attn(x, x, x, key_padding_mask=mask, need_weights=False)[0])
        return self.norm2(x + self.mlp(x)), mask


class MaskedLMHead(nn.Module):
    """Projection to the vocabulary, its weight the token embedding's when ``tied``."""

    def __init__(self, embed: BertEmbed, d: int, tied: bool):
        super().__init__()
        self.transform = nn.Linear(d, d)
        self.proj = nn.Linear(d, VOCAB)
        if tied:
            self.proj.weight = embed.tok.weight

    def forward(self, x, mask):
        return self.proj(torch.tanh(self.transform(x)))


def bert(
    tied: bool, d: int = 32, heads: int = 4, layers: int = 2, p: float = 0.1
) -> nn.Sequential:
    embed = BertEmbed(d, p)
    return nn.Sequential(
        embed, *[BertLayer(d, heads, p) for _ in range(layers)], MaskedLMHead(embed, d, tied)
    )


def mlp(p: float = 0.2) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.ReLU(),
        nn.Dropout(p),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Dropout(p),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 5),
    )


def token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def batch(kind: str, n: int, seed: int = 1) -> tuple[tuple, torch.Tensor]:
    """``((inputs...), target)`` for ``n`` samples of the model kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return (torch.randn(n, 3, 8, 8, generator=g),), torch.randint(0, 10, (n,), generator=g)
    if kind == "mlp":
        return (torch.randn(n, 16, generator=g),), torch.randint(0, 5, (n,), generator=g)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    if kind == "llama":
        return (ids,), torch.roll(ids, -1, 1)
    mask = torch.zeros(n, SEQ, dtype=torch.bool)
    mask[::2, -3:] = True  # every other sample padded at the end
    return (ids, mask), ids


MODELS = {  # kind -> (builder, loss)
    "cnn": (cnn, nn.functional.cross_entropy),
    "llama": (llama, token_loss),
    "bert-tied": (lambda: bert(tied=True), token_loss),
    "bert": (lambda: bert(tied=False), token_loss),
    "mlp": (mlp, nn.functional.cross_entropy),
}


def build(kind: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return MODELS[kind][0]()


def layers_of(kind: str) -> int:
    return len(harmony.decompose(build(kind)))
