"""The layers of the zoo's models (GPT-2, BERT, VGG, ResNet) as ``torch.nn``
modules: each one vLayer of a chain (see :mod:`harmony.costs.zoo`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def as_tuple(x) -> tuple:
    """A layer's output as the tuple the next layer is called with."""
    return x if isinstance(x, tuple) else (x,)


# ---- shared pieces -----------------------------------------------------------
def _attention(q, k, v, heads: int, bias: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v over ``heads`` heads, for inputs of shape [b, s, h].

    The attention is written as explicit matmuls, not ``scaled_dot_product_attention``,
    so that FlopCounterMode counts its 4·s²·h FLOPs per sample on every backend."""
    b, s, h = q.shape
    d = h // heads
    q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(d) + bias
    probs = dropout(scores.softmax(dim=-1))
    return (probs @ v).transpose(1, 2).reshape(b, s, h)


def init_transformer(module: nn.Module) -> None:
    """GPT-2 / BERT initialisation: N(0, 0.02) weights, zero biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


class CrossEntropyLoss(nn.Module):
    """The loss vLayer: mean cross-entropy of logits [..., classes] against integer targets
    [...]."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), target.flatten())


# ---- GPT-2 -------------------------------------------------------------------
class GPT2Embeddings(nn.Module):
    """Token plus position embeddings, then dropout."""

    def __init__(self, vocab: int, max_position: int, hidden: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_position, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class GPT2Attention(nn.Module):
    """Causal self-attention with one fused qkv projection and an output projection."""

    def __init__(self, hidden: int, heads: int, max_position: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # A float [ctx, ctx] buffer as in the reference implementation (4 MiB per
        # block at ctx 1024, counted in its buffer bytes). Stored additively.
        mask = torch.full((max_position, max_position), float("-inf")).triu(1)
        self.register_buffer("causal_bias", mask)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, max_position={self.causal_bias.shape[0]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        y = _attention(q, k, v, self.heads, self.causal_bias[:s, :s], self.attn_dropout)
        return self.resid_dropout(self.c_proj(y))


class GPT2MLP(nn.Module):
    """Linear to 4·hidden, GELU (tanh approximation, as GPT-2), linear back, dropout."""

    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class GPT2Layer(nn.Module):
    """One pre-LayerNorm transformer block: 12·h² + 13·h parameters."""

    def __init__(self, hidden: int, heads: int, max_position: int, dropout: float, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(hidden, heads, max_position, dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2LayerNorm(nn.LayerNorm):
    """The final LayerNorm, a vLayer of its own."""


class GPT2LMHead(nn.Module):
    """Projection to the vocabulary, not tied to the token embedding (as in the reference)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


# ---- BERT --------------------------------------------------------------------
class BertEmbeddings(nn.Module):
    """Token, position and segment embeddings, LayerNorm, dropout. The additive
    attention mask [b, 1, 1, s] passes through to the encoder layers."""

    def __init__(self, vocab, max_position, type_vocab, hidden, dropout, eps):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_position, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids, token_types, mask):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_types)
        )
        return self.dropout(self.LayerNorm(x)), mask


class BertAttention(nn.Module):
    """Self-attention with separate q, k, v projections, then dense, dropout, residual
    LayerNorm."""

    def __init__(self, hidden, heads, dropout, eps):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def extra_repr(self) -> str:
        return f"heads={self.heads}"

    def forward(self, x, mask):
        y = _attention(
            self.query(x), self.key(x), self.value(x), self.heads, mask, self.attn_dropout
        )
        return self.LayerNorm(x + self.dropout(self.dense(y)))


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer: 12·h² + 13·h parameters at intermediate 4·h.

    It returns ``(hidden, mask)`` for the next layer. The last layer returns the
    hidden states alone (``pass_mask=False``), as the pooler takes only them in
    the reference chain."""

    def __init__(self, hidden, heads, intermediate, dropout, eps, pass_mask: bool = True):
        super().__init__()
        self.pass_mask = pass_mask
        self.attention = BertAttention(hidden, heads, dropout, eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def extra_repr(self) -> str:
        return f"pass_mask={self.pass_mask}"

    def forward(self, x, mask):
        x = self.attention(x, mask)
        x = self.LayerNorm(x + self.dropout(self.output(self.act(self.intermediate(x)))))
        return (x, mask) if self.pass_mask else x


class BertPooler(nn.Module):
    """tanh(dense(hidden state of the first token))."""

    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.tanh(self.dense(x[:, 0]))


class BertClassifier(nn.Module):
    """Dropout, then the sequence-classification layer."""

    def __init__(self, hidden, num_labels, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x):
        return self.classifier(self.dropout(x))


# ---- VGG ---------------------------------------------------------------------
class ConvLayer(nn.Module):
    """3x3 convolution and ReLU, and the stage's 2x2 max-pool when it ends a stage."""

    def __init__(self, in_channels: int, out_channels: int, max_pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2) if max_pool else nn.Identity()

    def forward(self, x):
        return self.pool(self.relu(self.conv(x)))


class LinearLayer(nn.Module):
    """A fully connected layer of the classifier (flattening its input): with
    ReLU and dropout for the hidden ones, bare for the last."""

    def __init__(self, in_features: int, out_features: int, hidden: bool, dropout: float):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.act = (
            nn.Sequential(nn.ReLU(inplace=True), nn.Dropout(dropout)) if hidden else nn.Identity()
        )

    def forward(self, x):
        return self.act(self.fc(x.flatten(1)))


# ---- ResNet ------------------------------------------------------------------
class ResNetStem(nn.Module):
    """7x7/2 convolution, BatchNorm, ReLU, 3x3/2 max-pool: 224² → 56²."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(self.relu(self.bn(self.conv(x))))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection. A 1x1
    convolution downsamples the shortcut when the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
            if stride != 1 or inplanes != planes
            else nn.Identity()
        )

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class ResNetHead(nn.Module):
    """Global average pooling and the fully connected classifier."""

    def __init__(self, width: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))
