"""The paper's models as real ``torch.nn`` chains, and their cost models.

Every model is a chain of *vLayers*: layer ``i`` feeds layer ``i + 1`` and the
last layer is the loss. A layer returns a tensor or a tuple of tensors; the next
layer receives the tuple unpacked. The loss layer receives the previous output
plus the target (see :func:`forward`).

* :func:`build` makes the chain on any device. On ``meta`` a 40-billion-parameter
  GPT-2 costs no memory.
* :func:`example_input` makes a batch of inputs and targets with the right dtypes.
* :func:`spec` derives a :class:`~harmony.costs.spec.ModelSpec` analytically. It runs
  every layer on ``meta`` tensors at batch size 1, counts FLOPs with
  :class:`~torch.utils.flop_counter.FlopCounterMode` and sizes the tensors that
  autograd saves. Layers with the same structure are measured only once.

The architectures follow the reference profiles of the Harmony authors
(``harmony/data/reference/harmony-1080ti``). The parameter counts and the
number of vLayers match them exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..errors import HarmonyError
from .spec import Curve, LayerCost, ModelSpec, dtype_bytes

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


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


def _init_transformer(module: nn.Module) -> None:
    """GPT-2 / BERT initialisation: N(0, 0.02) weights, zero biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


class CrossEntropyLoss(nn.Module):
    """The loss vLayer: mean cross-entropy of logits [..., classes] against integer targets [...]."""

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
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_types))
        return self.dropout(self.LayerNorm(x)), mask


class BertAttention(nn.Module):
    """Self-attention with separate q, k, v projections, then dense, dropout, residual LayerNorm."""

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
        y = _attention(self.query(x), self.key(x), self.value(x), self.heads, mask, self.attn_dropout)
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
        self.act = nn.Sequential(nn.ReLU(inplace=True), nn.Dropout(dropout)) if hidden else nn.Identity()

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
            nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))
            if stride != 1 or inplanes != planes else nn.Identity()
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


# ---- configurations ----------------------------------------------------------
def _check(ok: bool, message: str) -> None:
    if not ok:
        raise HarmonyError(message)


def _check_fields(config) -> None:
    """Every setting of a ``*Config`` has the type its annotation says and a sane
    range (sizes and counts >= 1, dropout in [0, 1), epsilons > 0), so a bad
    ``--set`` is one clear error, not a traceback deep in a module or a model
    with no layers. Lists become tuples."""
    name = type(config).__name__
    for f in fields(config):
        v = getattr(config, f.name)
        kind = str(f.type)
        if kind == "int":
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                   f"{name}.{f.name} must be an integer >= 1, got {v!r}")
        elif kind == "float":
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                   f"{name}.{f.name} must be a number, got {v!r}")
            if f.name == "dropout":
                _check(0 <= v < 1, f"{name}.dropout must be in [0, 1), got {v!r}")
            else:
                _check(v > 0, f"{name}.{f.name} must be > 0, got {v!r}")
            object.__setattr__(config, f.name, float(v))
        elif kind.startswith("tuple"):
            _check(isinstance(v, (list, tuple)) and len(v) >= 1
                   and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v),
                   f"{name}.{f.name} must be a list of integers >= 1, got {v!r}")
            object.__setattr__(config, f.name, tuple(v))


@dataclass(frozen=True)
class GPT2Config:
    """A GPT-2 language model. vLayers: embeddings, ``n_layer`` blocks, final LayerNorm, LM head, loss."""

    hidden: int
    heads: int
    n_layer: int
    vocab: int = 50257
    max_position: int = 1024
    seq_len: int = 1024
    dropout: float = 0.1
    ln_eps: float = 1e-5
    optimizer: ClassVar[str] = "adamw"

    def __post_init__(self):
        _check_fields(self)
        _check(self.hidden % self.heads == 0, f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        _check(self.seq_len <= self.max_position,
               f"seq_len {self.seq_len} exceeds max_position {self.max_position}; raise max_position too")

    def layers(self) -> list[nn.Module]:
        h = self.hidden
        chain = [GPT2Embeddings(self.vocab, self.max_position, h, self.dropout)]
        chain += [GPT2Layer(h, self.heads, self.max_position, self.dropout, self.ln_eps)
                  for _ in range(self.n_layer)]
        chain += [GPT2LayerNorm(h, eps=self.ln_eps), GPT2LMHead(h, self.vocab), CrossEntropyLoss()]
        for layer in chain:
            _init_transformer(layer)
        return chain

    def example_input(self, batch: int, device) -> Batch:
        ids = torch.randint(0, self.vocab, (batch, self.seq_len), device=device)
        return (ids,), torch.roll(ids, -1, dims=1)  # predict the next token


@dataclass(frozen=True)
class BertConfig:
    """BERT for sequence classification. vLayers: embeddings, ``n_layer`` encoder
    layers, pooler, classifier, loss."""

    hidden: int = 1024
    heads: int = 16
    n_layer: int = 24
    intermediate: int = 4096
    vocab: int = 30522
    max_position: int = 512
    type_vocab: int = 2
    seq_len: int = 512
    num_labels: int = 2
    dropout: float = 0.1
    ln_eps: float = 1e-12
    optimizer: ClassVar[str] = "adam"

    def __post_init__(self):
        _check_fields(self)
        _check(self.hidden % self.heads == 0, f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        _check(self.seq_len <= self.max_position,
               f"seq_len {self.seq_len} exceeds max_position {self.max_position}; raise max_position too")
        _check(self.n_layer >= 1, "BERT needs at least one encoder layer")

    def layers(self) -> list[nn.Module]:
        h, p, eps = self.hidden, self.dropout, self.ln_eps
        chain = [BertEmbeddings(self.vocab, self.max_position, self.type_vocab, h, p, eps)]
        chain += [BertLayer(h, self.heads, self.intermediate, p, eps, pass_mask=i < self.n_layer - 1)
                  for i in range(self.n_layer)]
        chain += [BertPooler(h), BertClassifier(h, self.num_labels, p), CrossEntropyLoss()]
        for layer in chain:
            _init_transformer(layer)
        return chain

    def example_input(self, batch: int, device) -> Batch:
        ids = torch.randint(0, self.vocab, (batch, self.seq_len), device=device)
        token_types = torch.randint(0, self.type_vocab, (batch, self.seq_len), device=device)
        mask = torch.zeros(batch, 1, 1, self.seq_len, device=device)  # additive: attend everywhere
        return (ids, token_types, mask), torch.randint(0, self.num_labels, (batch,), device=device)


@dataclass(frozen=True)
class VGGConfig:
    """A VGG-style network without BatchNorm: 3x3 convolutions in stages, each
    stage ending in a 2x2 max-pool, then three fully connected layers.

    The default spreads 413 convolutions as the reference vgg416 does."""

    convs_per_stage: tuple[int, ...] = (82, 82, 83, 83, 83)
    widths: tuple[int, ...] = (64, 128, 256, 512, 512)
    image_size: int = 224
    fc_hidden: int = 4096
    num_classes: int = 1000
    dropout: float = 0.5
    optimizer: ClassVar[str] = "sgd-momentum"

    def __post_init__(self):
        _check_fields(self)
        stages = len(self.widths)
        _check(len(self.convs_per_stage) == stages, "convs_per_stage and widths need the same length")
        _check(min(self.convs_per_stage) >= 1, "every stage needs at least one convolution")
        _check(self.image_size % 2 ** stages == 0, f"image_size must be a multiple of {2 ** stages}")

    def layers(self) -> list[nn.Module]:
        chain, channels = [], 3
        for n, width in zip(self.convs_per_stage, self.widths):
            for i in range(n):
                chain.append(ConvLayer(channels, width, max_pool=i == n - 1))
                channels = width
        side = self.image_size // 2 ** len(self.widths)
        chain += [
            LinearLayer(channels * side * side, self.fc_hidden, hidden=True, dropout=self.dropout),
            LinearLayer(self.fc_hidden, self.fc_hidden, hidden=True, dropout=self.dropout),
            LinearLayer(self.fc_hidden, self.num_classes, hidden=False, dropout=0.0),
            CrossEntropyLoss(),
        ]
        return chain

    def example_input(self, batch: int, device) -> Batch:
        return _image_batch(batch, self.image_size, self.num_classes, device)


@dataclass(frozen=True)
class ResNetConfig:
    """A ResNet of BasicBlocks with BatchNorm. vLayers: stem, every block, head (avgpool + fc), loss."""

    blocks_per_stage: tuple[int, ...] = (128, 128, 128, 128)
    widths: tuple[int, ...] = (64, 128, 256, 512)
    image_size: int = 224
    num_classes: int = 1000
    optimizer: ClassVar[str] = "sgd-momentum"

    def __post_init__(self):
        _check_fields(self)
        stages = len(self.widths)
        _check(len(self.blocks_per_stage) == stages, "blocks_per_stage and widths need the same length")
        _check(min(self.blocks_per_stage) >= 1, "every stage needs at least one block")
        _check(self.image_size % 2 ** (stages + 1) == 0, f"image_size must be a multiple of {2 ** (stages + 1)}")

    def layers(self) -> list[nn.Module]:
        chain, inplanes = [ResNetStem(self.widths[0])], self.widths[0]
        for stage, (n, planes) in enumerate(zip(self.blocks_per_stage, self.widths)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                chain.append(BasicBlock(inplanes, planes, stride))
                inplanes = planes
        chain += [ResNetHead(inplanes, self.num_classes), CrossEntropyLoss()]
        return chain

    def example_input(self, batch: int, device) -> Batch:
        return _image_batch(batch, self.image_size, self.num_classes, device)


def _image_batch(batch: int, size: int, num_classes: int, device) -> Batch:
    images = torch.randn(batch, 3, size, size, device=device)
    return (images,), torch.randint(0, num_classes, (batch,), device=device)


# ---- the zoo -----------------------------------------------------------------
@dataclass(frozen=True)
class ZooEntry:
    """A named model: its configuration (a ``*Config``) and where it comes from."""

    name: str
    config: Any
    description: str

    @property
    def optimizer(self) -> str:
        return self.config.optimizer


def _gpt2(blocks: int, hidden: int = 4096, heads: int = 32) -> GPT2Config:
    return GPT2Config(hidden=hidden, heads=heads, n_layer=blocks)


MODELS: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("gpt2-tiny", GPT2Config(hidden=64, heads=4, n_layer=2, vocab=256, max_position=32, seq_len=32),
                 "GPT-2 shape at toy size, for tests"),
        ZooEntry("gpt2-medium", _gpt2(24, 1024, 16), "GPT-2 medium, 24 x 1024, untied LM head (406 M)"),
        ZooEntry("gpt2-xl", _gpt2(48, 1600, 25), "GPT-2 XL, 48 x 1600, untied LM head (1.64 B)"),
        ZooEntry("gpt2-10b", _gpt2(50), "Harmony's GPT-2 10B: 50 blocks of hidden 4096"),
        ZooEntry("gpt2-20b", _gpt2(100), "Harmony's GPT-2 20B: 100 blocks of hidden 4096"),
        ZooEntry("gpt2-30b", _gpt2(150), "Harmony's GPT-2 30B: 150 blocks of hidden 4096"),
        ZooEntry("gpt2-40b", _gpt2(200), "Harmony's GPT-2 40B: 200 blocks of hidden 4096"),
        ZooEntry("bert-tiny", BertConfig(hidden=64, heads=4, n_layer=2, intermediate=256, vocab=256,
                                         max_position=32, seq_len=32), "BERT shape at toy size, for tests"),
        ZooEntry("bert-large", BertConfig(), "BERT-Large, seq 512, 2-way classifier (335 M)"),
        ZooEntry("bert-96", BertConfig(n_layer=96), "Harmony's BERT-96: 96 BERT-Large layers, seq 512"),
        ZooEntry("vgg-tiny", VGGConfig(convs_per_stage=(1, 1, 2, 2, 2), widths=(8, 16, 32, 32, 32),
                                       image_size=32, fc_hidden=64, num_classes=10),
                 "VGG shape at toy size, for tests"),
        ZooEntry("vgg416", VGGConfig(), "Harmony's VGG416: 413 convolutions + 3 FC, 224x224 inputs"),
        ZooEntry("resnet-tiny", ResNetConfig(blocks_per_stage=(1, 1, 1, 1), widths=(8, 16, 32, 64),
                                             image_size=64, num_classes=10),
                 "ResNet shape at toy size, for tests"),
        ZooEntry("resnet1026", ResNetConfig(), "Harmony's ResNet1026: 4 x 128 BasicBlocks, 224x224 inputs"),
    ]
}


def _config(name: str, overrides: dict) -> Any:
    """The configuration of ``name`` with ``overrides`` applied, checked."""
    if name not in MODELS:
        raise HarmonyError(f"unknown model {name!r}; the zoo has {', '.join(sorted(MODELS))}")
    config = MODELS[name].config
    known = {f.name for f in fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise HarmonyError(f"{name} has no setting {', '.join(unknown)}; use one of {', '.join(sorted(known))}")
    return replace(config, **overrides)


def build(name: str, device="meta", **overrides) -> list[nn.Module]:
    """The vLayers of model ``name`` as modules created directly on ``device``
    (on ``meta`` nothing is allocated). ``overrides`` change configuration
    fields, e.g. ``n_layer=4`` or ``seq_len=128``."""
    config = _config(name, overrides)
    with torch.device(device):
        return config.layers()


def example_input(name: str, batch: int, device="cpu", **overrides) -> Batch:
    """A random batch for model ``name``: ``(inputs, target)`` where ``inputs``
    is the tuple of the first layer's arguments (int64 token ids for GPT-2/BERT,
    float images for VGG/ResNet) and ``target`` the int64 labels of the loss."""
    return _config(name, overrides).example_input(batch, device)


def forward(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Run a chain from :func:`build` on a batch from :func:`example_input` and return the loss."""
    x = inputs
    for layer in layers[:-1]:
        x = _as_tuple(layer(*x))
    return layers[-1](*x, target)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


# ---- the analytic cost model -------------------------------------------------
def spec(name: str, optimizer: str | None = None, dtype: str = "float32", **overrides) -> ModelSpec:
    """The cost model of ``name``, measured on ``meta`` tensors.

    Weights and activations are in ``dtype``. The optimizer defaults to the
    family's: AdamW for GPT-2, Adam for BERT, SGD with momentum for VGG/ResNet."""
    config = _config(name, overrides)
    dtype_bytes(dtype)  # validates the name
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        chain = [layer.to(torch_dtype) for layer in config.layers()]
    inputs, target = config.example_input(1, "meta")
    x = tuple(t.to(torch_dtype) if t.is_floating_point() else t for t in inputs)
    costs = []
    for i, layer in enumerate(chain):
        is_loss = i == len(chain) - 1
        m = _measure_cached(layer, x + (target,) if is_loss else x, grad_inputs=i > 0, dtype=torch_dtype)
        costs.append(_layer_cost(layer, x, m))
        x = tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in m.out_specs)
    label = name + "".join(f", {k}={v}" for k, v in sorted(overrides.items()))
    return ModelSpec(
        name=label,
        layers=tuple(costs),
        optimizer=optimizer or config.optimizer,
        param_dtype=dtype,
        act_dtype=dtype,
        target_bytes_per_sample=_nbytes(target),
        source=f"zoo:{name} (analytic, meta device)",
    )


@dataclass(frozen=True)
class _Measured:
    """What one layer costs at batch size 1 (FLOPs, bytes), and its output shapes."""

    param_numel: int
    buffer_numel: int
    fwd_flops: int
    bwd_flops: int
    fwd_extra: int
    bwd_extra: int
    out_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]


#: Measurements by structural signature: the 200 blocks of GPT-2 40B are measured once.
_MEASURED: dict[tuple, _Measured] = {}


def _measure_cached(layer: nn.Module, args: tuple[torch.Tensor, ...], grad_inputs: bool,
                    dtype: torch.dtype) -> _Measured:
    # repr() names the class and every size of the layer (extra_repr adds what
    # the submodules' reprs do not show); repr() omits the weights' dtype, and
    # integer arguments (token ids) do not carry it either.
    key = (repr(layer), dtype, tuple((t.shape, t.dtype) for t in args), grad_inputs)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(layer, args, grad_inputs)
    return _MEASURED[key]


def _layer_cost(layer: nn.Module, inputs: tuple[torch.Tensor, ...], m: _Measured) -> LayerCost:
    return LayerCost(
        name=type(layer).__name__,
        param_numel=m.param_numel,
        buffer_numel=m.buffer_numel,
        input_numel_per_sample=float(sum(t.numel() for t in inputs if t.is_floating_point())),
        input_fixed_bytes_per_sample=float(sum(_nbytes(t) for t in inputs if not t.is_floating_point())),
        fwd_flops_per_sample=float(m.fwd_flops),
        bwd_flops_per_sample=float(m.bwd_flops),
        fwd_extra=Curve.linear(m.fwd_extra),
        bwd_extra=Curve.linear(m.bwd_extra),
    )


def _measure(layer: nn.Module, args: tuple[torch.Tensor, ...], grad_inputs: bool) -> _Measured:
    """Measure a layer on meta arguments of batch size 1. ``grad_inputs``: whether
    backward computes the gradient of the float arguments (all layers but the first)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    param_names = {n for n, _ in layer.named_parameters()}
    # Persistent buffers are what the state dict holds beyond the parameters.
    # BatchNorm's int64 step counter counts as one element.
    buffer_numel = sum(t.numel() for n, t in layer.state_dict().items() if n not in param_names)
    fwd_flops, fwd_extra, outputs = _forward_costs(layer, args)
    bwd_flops, bwd_extra = _backward_costs(layer, args, grad_inputs)
    return _Measured(
        param_numel=sum(p.numel() for p in params),
        buffer_numel=buffer_numel,
        fwd_flops=fwd_flops,
        bwd_flops=bwd_flops,
        fwd_extra=fwd_extra,
        bwd_extra=bwd_extra,
        out_specs=tuple((tuple(t.shape), t.dtype) for t in outputs),
    )


class _OpOutputs(TorchDispatchMode):
    """Keeps every tensor an operator returns (meta tensors: free), so their
    storages stay distinct and can be sized afterwards."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += [t for t in _as_tuple(out) if isinstance(t, torch.Tensor)]
        return out


def _forward_costs(layer, args) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """Forward without autograd: FLOPs, and the bytes of the output plus the
    largest temporary (a storage that is neither an argument, a weight nor the output)."""
    with torch.no_grad(), FlopCounterMode(display=False) as flops, _OpOutputs() as ops:
        outputs = _as_tuple(layer(*args))
    known = _storages(args) | _storages(_weights(layer)) | _storages(outputs)
    temporaries = {_storage_id(t): t.untyped_storage().nbytes() for t in ops.tensors}
    largest = max((b for s, b in temporaries.items() if s not in known), default=0)
    produced = {_storage_id(t): _nbytes(t) for t in outputs if _storage_id(t) not in _storages(args)}
    return flops.get_total_flops(), sum(produced.values()) + largest, outputs


def _backward_costs(layer, args, grad_inputs: bool) -> tuple[int, int]:
    """Recompute forward with autograd and run backward: FLOPs of both, and the
    bytes autograd saves (excluding the arguments and the weights) plus the
    output gradients and the input gradients."""
    args = tuple(t.detach().requires_grad_(grad_inputs and t.is_floating_point()) for t in args)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # The graph keeps every packed tensor alive, so storage ids do not get reused.
        saved[_storage_id(t)] = t.untyped_storage().nbytes()
        return t

    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs = [t for t in _as_tuple(layer(*args)) if t.grad_fn is not None]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    known = _storages(args) | _storages(_weights(layer))
    saved_bytes = sum(b for s, b in saved.items() if s not in known)
    grad_bytes = sum(_nbytes(t) for t in outputs) + sum(_nbytes(t) for t in args if t.requires_grad)
    layer.zero_grad(set_to_none=True)
    return flops.get_total_flops(), saved_bytes + grad_bytes


def _weights(layer: nn.Module) -> list[torch.Tensor]:
    return [*layer.parameters(), *layer.buffers()]


def _storage_id(t: torch.Tensor) -> int:
    # Meta tensors have no data pointer, but views share the storage object.
    return t.untyped_storage()._cdata


def _storages(tensors) -> set[int]:
    return {_storage_id(t) for t in tensors}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
