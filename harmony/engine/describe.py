"""The sizes of a real chain of layers, as a ModelSpec without times.

The engine needs a spec to build its task graph even when it is handed a plan:
the graph's structure and byte counts come from parameter and activation
sizes, which one forward pass over a single sample tells. The profiler
(:mod:`harmony.engine.profiler`) adds measured times and working memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import HarmonyError
from ..spec import LayerCost, ModelSpec
from .reference_loop import as_args

_FLOAT_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


def split_bytes(tensors) -> tuple[float, float]:
    """(floating-point elements, bytes of everything else) of a tuple of tensors."""
    floats, fixed = 0.0, 0.0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_floating_point():
            floats += t.numel()
        else:
            fixed += t.numel() * t.element_size()
    return floats, fixed


def layer_inputs(layers: Sequence[nn.Module], inputs: tuple) -> list[tuple]:
    """The input of every layer (and, last, the chain's output) for ``inputs``."""
    out = [inputs]
    h = inputs
    with torch.no_grad():
        for layer in layers:
            h = as_args(layer(*h))
            out.append(h)
    return out


def norm_tensor_names(layer: nn.Module) -> set[str]:
    """Names of ``layer``'s BatchNorm parameters and buffers (float32 under autocast)."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, m in layer.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for name, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))}


def act_dtype(layers: Sequence[nn.Module]) -> str:
    for p in (p for layer in layers for p in layer.parameters()):
        return _FLOAT_NAMES.get(p.dtype, "float32")
    return "float32"


def describe(layers: Sequence[nn.Module], inputs: tuple, target: torch.Tensor, name: str = "model",
             optimizer: str = "adamw") -> ModelSpec:
    """Sizes per layer from one sample of ``inputs``; times and working memory zero."""
    one = tuple(t[:1] for t in inputs)
    was_training = [layer.training for layer in layers]
    for layer in layers:
        layer.eval()  # a forward for sizes must not touch BatchNorm statistics
    try:
        acts = layer_inputs(layers, one)
    except Exception as e:  # the model's own error, about the user's inputs
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
        raise HarmonyError(
            f"the model cannot run on the given inputs ({shapes}): {type(e).__name__}: {e}. "
            "Pass inputs of the shape and dtype its first layer expects."
        ) from None
    finally:
        for layer, mode in zip(layers, was_training):
            layer.train(mode)
    dtype = act_dtype(layers)
    norms = [norm_tensor_names(layer) for layer in layers]
    costs = []
    for i, layer in enumerate(layers):
        floats, fixed = split_bytes(acts[i])
        costs.append(LayerCost(
            name=f"{i}:{type(layer).__name__}",
            param_numel=sum(p.numel() for p in layer.parameters()),
            buffer_numel=sum(b.numel() for b in layer.buffers() if b.is_floating_point()),
            norm_param_numel=sum(p.numel() for name, p in layer.named_parameters() if name in norms[i]),
            norm_buffer_numel=sum(b.numel() for name, b in layer.named_buffers()
                                  if name in norms[i] and b.is_floating_point()),
            fixed_buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers() if not b.is_floating_point()),
            input_numel_per_sample=floats,
            input_fixed_bytes_per_sample=fixed,
        ))
    per_sample = target[:1]
    return ModelSpec(name=name, layers=tuple(costs), optimizer=optimizer, param_dtype=dtype, act_dtype=dtype,
                     master_dtype=dtype,
                     target_bytes_per_sample=float(per_sample.numel() * per_sample.element_size()),
                     source="described from the real modules (sizes only)")
