"""What the engine holds running one layer, measured: :func:`working_memory` runs
it with autograd as the engine's recompute does and meters what autograd saves
(:class:`Held`), the way the engine's meters count it
(:mod:`harmony.engine.meters`); :func:`~harmony.engine.describe.describe` makes a
spec of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from .meters import SavedBytes, storage_key
from .reference_loop import as_args


def norm_tensor_names(layer: nn.Module) -> set[str]:
    """Names of ``layer``'s BatchNorm parameters and buffers (float32 under autocast)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, m in layer.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for name, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
    }


@dataclass(frozen=True)
class Held:
    """What autograd keeps while the engine recomputes one layer (bytes): in all,
    and of it the layer's own input and its own output; and the forward's FLOPs."""

    saved: float
    saved_input: float
    saved_output: float
    flops: float
    #: bytes kept of each input and output element, by ("in" | "out", index); an
    #: output that is an input handed on is counted as the input
    kept: dict = field(default_factory=dict)
    #: per output element, what it is (:func:`handed_on`)
    handed_on: tuple = ()


def working_memory(
    layer: nn.Module,
    inputs: tuple,
    loss_fn: Callable | None,
    target: torch.Tensor,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype | None = None,
) -> Held:
    """Run ``layer`` with autograd the way the engine's recompute does (on copies
    of its weights and buffers on ``device``, so nothing of the model changes,
    and with the random generators restored after) and meter what autograd
    saves. The input is passed as a non-leaf, as inside a pack, so that keeping
    it counts. ``dtype``: under ``torch.autocast``, with activations in it."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device, copy=True)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    norms = norm_tensor_names(layer)
    weights = {
        n: (p.detach().to(device, copy=True) if n in norms else copy(p)).requires_grad_(
            p.requires_grad
        )
        for n, p in layer.named_parameters()
    }
    weights.update(
        {
            n: b.detach().to(device, copy=True) if n in norms else copy(b)
            for n, b in layer.named_buffers()
        }
    )
    leaves = tuple(
        copy(t).requires_grad_(True) if t.is_floating_point() else copy(t) for t in inputs
    )
    xs = tuple(t.view_as(t) if t.requires_grad else t for t in leaves)
    target = target.to(device, copy=True)
    meter = SavedBytes(exclude=[*weights.values(), target])  # as the engine's (Compute.backward)
    devices = [device] if device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices),
        meter,
        torch.enable_grad(),
        FlopCounterMode(display=False) as flops,
        torch.autocast(device.type, dtype=dtype, enabled=dtype is not None),
    ):
        out = as_args(functional_call(layer, weights, xs))
        if loss_fn is not None:
            loss_fn(*out, target)

    def kept(tensors) -> float:
        keys = {
            storage_key(t): t.untyped_storage().nbytes()
            for t in tensors
            if isinstance(t, torch.Tensor) and storage_key(t) in meter.seen
        }
        return float(sum(keys.values()))

    return Held(
        float(meter.total),
        kept(leaves),
        0.0 if loss_fn is not None else kept(out),
        float(flops.get_total_flops()),
        kept_parts(leaves, out, meter.seen),
        handed_on(leaves, out),
    )


def kept_parts(leaves: tuple, out: tuple, seen: set) -> dict:
    """The bytes autograd keeps of each input and output element, once per storage
    (an output that shares an input's storage is that input)."""
    parts, keys = {}, set()
    for role, tensors in (("in", leaves), ("out", out)):
        for k, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and storage_key(t) in seen - keys:
                keys.add(storage_key(t))
                parts[role, k] = float(t.untyped_storage().nbytes())
    return parts


def handed_on(leaves: tuple, out: tuple) -> tuple:
    """What each output element is: ("in", k) when it shares input element ``k``'s
    storage (handed on unchanged, or a view), else ("out", e) with ``e`` the first
    output element of its storage (an output returned twice is one tensor)."""
    first = {
        storage_key(t): ("in", k) for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)
    }
    refs = []
    for e, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            refs.append(("out", e))
            continue
        refs.append(first.setdefault(storage_key(t), ("out", e)))
    return tuple(refs)
