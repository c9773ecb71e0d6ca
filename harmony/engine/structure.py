"""What a layer's description depends on, as a key: layers with equal keys (a
transformer's blocks) are described once (:func:`~.describe.describe`: the memory
autograd keeps for them, their FLOPs) and share the result. Their times are still
measured one by one (:mod:`.profiler`): one block timed for all of them left the
simulator 9% optimistic on an emulated GPU.

The memory autograd keeps for a layer depends on its class, its
modules' hyperparameters (as they print, and their plain attributes: a head
count or a dropout rate kept as a number), the shapes and dtypes of its tensors,
its modules' training flags, and the shapes of its input and which of the input's
tensors share storage (a block handed the same tensor twice keeps it once); not
on the values of its weights, nor on the layer's position in the model, which
transformers layers keep as an attribute (``layer_idx``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def _tensors(values: Iterable) -> tuple:
    """Shapes, dtypes and autograd flags of tensors; the repr of anything else;
    for each element, the first element whose storage it shares."""
    values = tuple(values)
    storages = [
        v.untyped_storage().data_ptr()
        if isinstance(v, torch.Tensor) and v.device.type != "meta"
        else None
        for v in values
    ]
    return tuple(
        (tuple(v.shape), v.dtype, v.requires_grad, storages.index(s) if s is not None else k)
        if isinstance(v, torch.Tensor)
        else (type(v), repr(v))
        for k, (v, s) in enumerate(zip(values, storages))
    )


#: attributes that say where a layer sits, not what it computes
POSITION_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})


def _value(v) -> object:
    """A plain attribute as part of a key: numbers, strings and flags as they are,
    tensors by shape and dtype, functions by name, other objects by their type."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    return getattr(v, "__qualname__", None) or type(v)


def _attributes(layer: nn.Module) -> tuple:
    """Every module's own public attributes (torch keeps its own state in private ones)."""
    return tuple(
        tuple(
            (name, _value(v))
            for name, v in sorted(vars(m).items())
            if not name.startswith("_") and name != "training" and name not in POSITION_ATTRIBUTES
        )
        for m in layer.modules()
    )


def structure(layer: nn.Module, inputs: Iterable[tuple], last: bool) -> tuple:
    """The key of ``layer`` run on each of ``inputs`` (one tuple of arguments per
    microbatch size), ``last``: with the loss after it."""
    return (
        type(layer),
        repr(layer),
        _attributes(layer),
        tuple((n, *_tensors([p])) for n, p in layer.named_parameters()),
        tuple((n, *_tensors([b])) for n, b in layer.named_buffers()),
        tuple(m.training for m in layer.modules()),
        tuple(_tensors(x) for x in inputs),
        last,
    )
