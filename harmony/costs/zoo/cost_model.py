"""The zoo's analytic cost model: a :class:`~harmony.costs.spec.ModelSpec`
measured by running each vLayer on ``meta`` tensors (no memory, any size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..curve import Curve
from ..layer import LayerCost
from ..spec import ModelSpec, dtype_bytes
from .modules import as_tuple
from .registry import config_of


# ---- the analytic cost model -------------------------------------------------
def spec(
    name: str, optimizer: str | None = None, dtype: str = "float32", **overrides
) -> ModelSpec:
    """The cost model of ``name``, measured on ``meta`` tensors.

    Weights and activations are in ``dtype``. The optimizer defaults to the
    family's: AdamW for GPT-2, Adam for BERT, SGD with momentum for VGG/ResNet."""
    config = config_of(name, overrides)
    dtype_bytes(dtype)  # validates the name
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        chain = [layer.to(torch_dtype) for layer in config.layers()]
    inputs, target = config.example_input(1, "meta")
    x = tuple(t.to(torch_dtype) if t.is_floating_point() else t for t in inputs)
    costs = []
    for i, layer in enumerate(chain):
        is_loss = i == len(chain) - 1
        m = _measure_cached(
            layer, x + (target,) if is_loss else x, grad_inputs=i > 0, dtype=torch_dtype
        )
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


def _measure_cached(
    layer: nn.Module, args: tuple[torch.Tensor, ...], grad_inputs: bool, dtype: torch.dtype
) -> _Measured:
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
        input_fixed_bytes_per_sample=float(
            sum(_nbytes(t) for t in inputs if not t.is_floating_point())
        ),
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
        self.tensors += [t for t in as_tuple(out) if isinstance(t, torch.Tensor)]
        return out


def _forward_costs(layer, args) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """Forward without autograd: FLOPs, and the bytes of the output plus the
    largest temporary (a storage that is neither an argument, a weight nor the output)."""
    with torch.no_grad(), FlopCounterMode(display=False) as flops, _OpOutputs() as ops:
        outputs = as_tuple(layer(*args))
    known = _storages(args) | _storages(_weights(layer)) | _storages(outputs)
    temporaries = {_storage_id(t): t.untyped_storage().nbytes() for t in ops.tensors}
    largest = max((b for s, b in temporaries.items() if s not in known), default=0)
    produced = {
        _storage_id(t): _nbytes(t) for t in outputs if _storage_id(t) not in _storages(args)
    }
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
            outputs = [t for t in as_tuple(layer(*args)) if t.grad_fn is not None]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    known = _storages(args) | _storages(_weights(layer))
    saved_bytes = sum(b for s, b in saved.items() if s not in known)
    grad_bytes = sum(_nbytes(t) for t in outputs) + sum(
        _nbytes(t) for t in args if t.requires_grad
    )
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
