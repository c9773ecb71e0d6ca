"""The zoo's named models: a configuration each, built on any device."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
from torch import nn

from ...errors import HarmonyError
from .configs import Batch, BertConfig, GPT2Config, ResNetConfig, VGGConfig
from .modules import as_tuple


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
        ZooEntry(
            "gpt2-tiny",
            GPT2Config(hidden=64, heads=4, n_layer=2, vocab=256, max_position=32, seq_len=32),
            "GPT-2 shape at toy size, for tests",
        ),
        ZooEntry(
            "gpt2-medium", _gpt2(24, 1024, 16), "GPT-2 medium, 24 x 1024, untied LM head (406 M)"
        ),
        ZooEntry("gpt2-xl", _gpt2(48, 1600, 25), "GPT-2 XL, 48 x 1600, untied LM head (1.64 B)"),
        ZooEntry("gpt2-10b", _gpt2(50), "Harmony's GPT-2 10B: 50 blocks of hidden 4096"),
        ZooEntry("gpt2-20b", _gpt2(100), "Harmony's GPT-2 20B: 100 blocks of hidden 4096"),
        ZooEntry("gpt2-30b", _gpt2(150), "Harmony's GPT-2 30B: 150 blocks of hidden 4096"),
        ZooEntry("gpt2-40b", _gpt2(200), "Harmony's GPT-2 40B: 200 blocks of hidden 4096"),
        ZooEntry(
            "bert-tiny",
            BertConfig(
                hidden=64,
                heads=4,
                n_layer=2,
                intermediate=256,
                vocab=256,
                max_position=32,
                seq_len=32,
            ),
            "BERT shape at toy size, for tests",
        ),
        ZooEntry("bert-large", BertConfig(), "BERT-Large, seq 512, 2-way classifier (335 M)"),
        ZooEntry(
            "bert-96", BertConfig(n_layer=96), "Harmony's BERT-96: 96 BERT-Large layers, seq 512"
        ),
        ZooEntry(
            "vgg-tiny",
            VGGConfig(
                convs_per_stage=(1, 1, 2, 2, 2),
                widths=(8, 16, 32, 32, 32),
                image_size=32,
                fc_hidden=64,
                num_classes=10,
            ),
            "VGG shape at toy size, for tests",
        ),
        ZooEntry(
            "vgg416", VGGConfig(), "Harmony's VGG416: 413 convolutions + 3 FC, 224x224 inputs"
        ),
        ZooEntry(
            "resnet-tiny",
            ResNetConfig(
                blocks_per_stage=(1, 1, 1, 1),
                widths=(8, 16, 32, 64),
                image_size=64,
                num_classes=10,
            ),
            "ResNet shape at toy size, for tests",
        ),
        ZooEntry(
            "resnet1026",
            ResNetConfig(),
            "Harmony's ResNet1026: 4 x 128 BasicBlocks, 224x224 inputs",
        ),
    ]
}


def config_of(name: str, overrides: dict) -> Any:
    """The configuration of ``name`` with ``overrides`` applied, checked."""
    if name not in MODELS:
        raise HarmonyError(f"unknown model {name!r}; the zoo has {', '.join(sorted(MODELS))}")
    config = MODELS[name].config
    known = {f.name for f in fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise HarmonyError(
            f"{name} has no setting {', '.join(unknown)}; use one of {', '.join(sorted(known))}"
        )
    return replace(config, **overrides)


def build(name: str, device="meta", **overrides) -> list[nn.Module]:
    """The vLayers of model ``name`` as modules created directly on ``device``
    (on ``meta`` nothing is allocated). ``overrides`` change configuration
    fields, e.g. ``n_layer=4`` or ``seq_len=128``."""
    config = config_of(name, overrides)
    with torch.device(device):
        return config.layers()


def layer_init(name: str) -> Callable[[nn.Module], None] | None:
    """What ``name``'s layers are initialised with beyond their modules'
    ``reset_parameters()`` (GPT-2's and BERT's N(0, 0.02); None: nothing more):
    the ``init=`` of an engine that makes a model built under
    ``harmony.empty_weights()``."""
    return getattr(config_of(name, {}), "layer_init", None)


def example_input(name: str, batch: int, device="cpu", **overrides) -> Batch:
    """A random batch for model ``name``: ``(inputs, target)`` where ``inputs``
    is the tuple of the first layer's arguments (int64 token ids for GPT-2/BERT,
    float images for VGG/ResNet) and ``target`` the int64 labels of the loss."""
    return config_of(name, overrides).example_input(batch, device)


def forward(
    layers: list[nn.Module], inputs: tuple[torch.Tensor, ...], target: torch.Tensor
) -> torch.Tensor:
    """Run a chain from :func:`build` on a batch from :func:`example_input` and return the loss."""
    x = inputs
    for layer in layers[:-1]:
        x = as_tuple(layer(*x))
    return layers[-1](*x, target)
