"""The zoo's model families as frozen, checked configurations: each builds
its chain of vLayers (:meth:`layers`) and a random batch (:meth:`example_input`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import nn

from ...errors import HarmonyError
from .modules import (
    BasicBlock,
    BertClassifier,
    BertEmbeddings,
    BertLayer,
    BertPooler,
    ConvLayer,
    CrossEntropyLoss,
    GPT2Embeddings,
    GPT2Layer,
    GPT2LayerNorm,
    GPT2LMHead,
    LinearLayer,
    ResNetHead,
    ResNetStem,
    init_transformer,
)

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


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
            _check(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                f"{name}.{f.name} must be an integer >= 1, got {v!r}",
            )
        elif kind == "float":
            _check(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                f"{name}.{f.name} must be a number, got {v!r}",
            )
            if f.name == "dropout":
                _check(0 <= v < 1, f"{name}.dropout must be in [0, 1), got {v!r}")
            else:
                _check(v > 0, f"{name}.{f.name} must be > 0, got {v!r}")
            object.__setattr__(config, f.name, float(v))
        elif kind.startswith("tuple"):
            _check(
                isinstance(v, (list, tuple))
                and len(v) >= 1
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v),
                f"{name}.{f.name} must be a list of integers >= 1, got {v!r}",
            )
            object.__setattr__(config, f.name, tuple(v))


def _check_transformer(config) -> None:
    """A transformer's settings: heads split the hidden size, the sequence fits the positions."""
    _check_fields(config)
    _check(
        config.hidden % config.heads == 0,
        f"hidden {config.hidden} is not a multiple of heads {config.heads}",
    )
    _check(
        config.seq_len <= config.max_position,
        f"seq_len {config.seq_len} exceeds max_position {config.max_position}; raise "
        "max_position too",
    )


def _check_stages(config, counts: str, image_multiple: int) -> None:
    """A CNN's settings: one count (``counts``, each >= 1 by its type) per stage
    width, and an image size that every downsampling divides."""
    _check_fields(config)
    _check(
        len(getattr(config, counts)) == len(config.widths),
        f"{counts} and widths need the same length",
    )
    _check(
        config.image_size % image_multiple == 0,
        f"image_size must be a multiple of {image_multiple}",
    )


@dataclass(frozen=True)
class GPT2Config:
    """A GPT-2 language model. vLayers: embeddings, ``n_layer`` blocks, final LayerNorm, LM head,
    loss."""

    hidden: int
    heads: int
    n_layer: int
    vocab: int = 50257
    max_position: int = 1024
    seq_len: int = 1024
    dropout: float = 0.1
    ln_eps: float = 1e-5
    optimizer: ClassVar[str] = "adamw"
    #: initialises a layer after its modules' reset_parameters() (see registry.layer_init)
    layer_init: ClassVar = staticmethod(init_transformer)

    def __post_init__(self):
        _check_transformer(self)

    def layers(self) -> list[nn.Module]:
        h = self.hidden
        chain = [GPT2Embeddings(self.vocab, self.max_position, h, self.dropout)]
        chain += [
            GPT2Layer(h, self.heads, self.max_position, self.dropout, self.ln_eps)
            for _ in range(self.n_layer)
        ]
        chain += [GPT2LayerNorm(h, eps=self.ln_eps), GPT2LMHead(h, self.vocab), CrossEntropyLoss()]
        for layer in chain:
            self.layer_init(layer)
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
    layer_init: ClassVar = staticmethod(init_transformer)

    def __post_init__(self):
        _check_transformer(self)

    def layers(self) -> list[nn.Module]:
        h, p, eps = self.hidden, self.dropout, self.ln_eps
        chain = [BertEmbeddings(self.vocab, self.max_position, self.type_vocab, h, p, eps)]
        chain += [
            BertLayer(h, self.heads, self.intermediate, p, eps, pass_mask=i < self.n_layer - 1)
            for i in range(self.n_layer)
        ]
        chain += [BertPooler(h), BertClassifier(h, self.num_labels, p), CrossEntropyLoss()]
        for layer in chain:
            self.layer_init(layer)
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
        # each stage's max-pool halves the image
        _check_stages(self, "convs_per_stage", 2 ** len(self.widths))

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
    """A ResNet of BasicBlocks with BatchNorm. vLayers: stem, every block, head (avgpool + fc),
    loss."""

    blocks_per_stage: tuple[int, ...] = (128, 128, 128, 128)
    widths: tuple[int, ...] = (64, 128, 256, 512)
    image_size: int = 224
    num_classes: int = 1000
    optimizer: ClassVar[str] = "sgd-momentum"

    def __post_init__(self):
        # the stem halves the image twice, the first block of every later stage once
        _check_stages(self, "blocks_per_stage", 2 ** (len(self.widths) + 1))

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
