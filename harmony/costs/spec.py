"""What each layer of a model costs: the cost model every policy, the simulator
and the planner read.

A :class:`ModelSpec` is a chain of :class:`~harmony.costs.layer.LayerCost`
(layer ``i`` feeds layer ``i + 1``; the last layer computes the loss). Sizes
are stored as *element counts* and turned into bytes through the spec's
dtypes, so the same spec answers for float32 and for bf16/fp16 mixed
precision. Times and working memory are functions of the microbatch size
``u``: a :class:`~harmony.costs.curve.Curve` (a measured table with
interpolation, or a line through the origin derived from FLOPs / bytes per
sample).

Where a spec comes from:

* :mod:`harmony.costs.zoo` builds real modules on the ``meta`` device and counts
  FLOPs and activation sizes per layer (any size, no memory);
* :mod:`harmony.costs.reference` loads the per-layer profiles measured on GTX 1080 Ti
  by the Harmony authors;
* the engine's profiler measures the layers on the device at hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

from ..errors import HarmonyError
from .curve import Curve
from .layer import LayerCost, Tie

# Curve, LayerCost and Tie live in their own modules; they are imported from here too
__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_STATE_SLOTS",
    "PRECISION_DTYPES",
    "Curve",
    "LayerCost",
    "ModelSpec",
    "Tie",
    "dtype_bytes",
    "state_slots",
]

#: Bytes per element of the dtypes that move between host and device.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

#: Optimizer-state tensors per parameter element (host-resident, fp32). Any other
#: optimizer is named by what it keeps, ``"slots:N"`` (the engine counts them).
OPTIMIZER_STATE_SLOTS = {
    "sgd": 0,
    "sgd-momentum": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "adam": 2,
    "adamw": 2,
    "amsgrad": 3,
}


def state_slots(optimizer: str) -> int:
    """Optimizer-state tensors per parameter element of ``optimizer``: a name of
    :data:`OPTIMIZER_STATE_SLOTS`, or ``"slots:N"``."""
    if optimizer in OPTIMIZER_STATE_SLOTS:
        return OPTIMIZER_STATE_SLOTS[optimizer]
    m = re.fullmatch(r"slots:(\d+)", str(optimizer))
    if m is None:
        raise HarmonyError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_SLOTS)} or "
            "'slots:N' (N tensors of each parameter's size)"
        )
    return int(m.group(1))


#: a run's precision -> the dtype weights, gradients and activations cross the links in
#: (mixed precision keeps float32 master weights and optimizer state on the host)
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise HarmonyError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelSpec:
    """A model as a chain of layer costs plus the dtypes of what moves."""

    name: str
    layers: tuple[LayerCost, ...]
    optimizer: str = "adamw"
    param_dtype: str = "float32"  # weights and gradients as they cross the link
    act_dtype: str = "float32"  # activations and stashed inputs
    #: the host's master weights. Under mixed precision (a ``param_dtype`` lower than
    #: this) BatchNorm's parameters and statistics still cross in it, as autocast
    #: keeps BatchNorm in float32. None: ``param_dtype`` (weights of one dtype)
    master_dtype: str | None = None
    #: bytes of the labels per sample, read by the last layer
    target_bytes_per_sample: float = 0.0
    source: str = ""
    #: parameters shared by several layers
    ties: tuple[Tie, ...] = ()
    #: the fewest samples the model trains on at once (2 with BatchNorm over features:
    #: it needs more than one value per channel)
    min_microbatch: int = 1

    def __post_init__(self) -> None:
        if not self.layers:
            raise HarmonyError(f"model spec {self.name!r} has no layers")
        state_slots(self.optimizer)
        dtype_bytes(self.param_dtype)
        dtype_bytes(self.act_dtype)
        if self.master_dtype is not None:
            dtype_bytes(self.master_dtype)
        object.__setattr__(self, "ties", tuple(self.ties))
        if not isinstance(self.min_microbatch, int) or self.min_microbatch < 1:
            raise HarmonyError(
                f"model spec {self.name!r}: min_microbatch must be an integer >= 1, "
                f"got {self.min_microbatch!r}"
            )
        for t in self.ties:
            if (
                not isinstance(t, Tie)
                or len(t.layers) < 2
                or list(t.layers) != sorted(set(t.layers))
                or t.layers[0] < 0
                or t.layers[-1] >= len(self.layers)
                or any(t.numel > self.layers[i].param_numel for i in t.layers)
            ):
                raise HarmonyError(
                    f"model spec {self.name!r}: a tie must name two or more distinct layers in "
                    f"order, each holding its elements; got {t!r}"
                )

    # ---- sizes -------------------------------------------------------------
    @property
    def has_times(self) -> bool:
        """Whether every layer's times are known (measured, or FLOPs to derive them from)."""
        return all(
            (c.fwd_time is not None or c.fwd_flops_per_sample > 0)
            and (c.bwd_time is not None or c.bwd_flops_per_sample > 0)
            for c in self.layers
        )

    def __len__(self) -> int:
        return len(self.layers)

    @cached_property
    def _weight_prefix(self) -> list[tuple[int, int]]:
        """Running sums of (weight bytes, gradient bytes) on the link, layer by layer."""
        low, master = (
            dtype_bytes(self.param_dtype),
            dtype_bytes(self.master_dtype or self.param_dtype),
        )
        out = [(0, 0)]
        for c in self.layers:
            grads = (c.param_numel - c.norm_param_numel) * low + c.norm_param_numel * master
            buffers = (c.buffer_numel - c.norm_buffer_numel) * low + c.norm_buffer_numel * master
            weights = grads + buffers + c.fixed_buffer_bytes
            out.append((out[-1][0] + weights, out[-1][1] + grads))
        return out

    @property
    def num_params(self) -> int:
        return sum(layer.param_numel for layer in self.layers) - sum(
            t.numel * (len(t.layers) - 1) for t in self.ties
        )

    def _shared(self, start: int, stop: int) -> int:
        """Elements of tied parameters counted more than once among layers [start, stop)."""
        return sum(t.numel * max(0, t.in_range(start, stop) - 1) for t in self.ties)

    def weight_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of weights (parameters + buffers) of layers [start, stop) on the
        link, a tied parameter once."""
        stop = len(self.layers) if stop is None else stop
        shared = self._shared(start, stop) * dtype_bytes(self.param_dtype) if self.ties else 0
        return self._weight_prefix[stop][0] - self._weight_prefix[start][0] - shared

    def grad_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of the weight gradients of layers [start, stop) on the link, a
        tied parameter once."""
        stop = len(self.layers) if stop is None else stop
        shared = self._shared(start, stop) * dtype_bytes(self.param_dtype) if self.ties else 0
        return self._weight_prefix[stop][1] - self._weight_prefix[start][1] - shared

    def split_tie_bytes(self, start: int, stop: int) -> int:
        """Gradient bytes of the parameters that layers [start, stop) share with
        layers outside it: their gradient is summed with the other layers' per
        microbatch, as autograd sums it, so it leaves the device per microbatch."""
        return sum(
            t.numel for t in self.ties if 0 < t.in_range(start, stop) < len(t.layers)
        ) * dtype_bytes(self.param_dtype)

    def optimizer_state_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """Host bytes of optimizer state (fp32 master copies are separate)."""
        stop = len(self.layers) if stop is None else stop
        n = sum(layer.param_numel for layer in self.layers[start:stop]) - self._shared(start, stop)
        return n * 4 * state_slots(self.optimizer)

    def input_bytes(self, layer: int, u: float) -> float:
        """Bytes of the input of ``layer`` for a microbatch of ``u`` samples.

        ``layer == len(self)`` is the model output (the loss layer's output is
        a scalar, so 0)."""
        if layer >= len(self.layers):
            return 0.0
        c = self.layers[layer]
        return u * (
            c.input_numel_per_sample * dtype_bytes(self.act_dtype) + c.input_fixed_bytes_per_sample
        )

    def input_grad_bytes(self, layer: int, u: float) -> float:
        """Bytes of the gradient of the input of ``layer`` (its floating-point part:
        token ids and boolean masks have none)."""
        if layer >= len(self.layers):
            return 0.0
        return u * self.layers[layer].input_numel_per_sample * dtype_bytes(self.act_dtype)

    def target_bytes(self, u: float) -> float:
        return u * self.target_bytes_per_sample

    # ---- times -------------------------------------------------------------
    def fwd_time(self, start: int, stop: int, u: float, flops: float) -> float:
        """Seconds to run layers [start, stop) forward (no autograd) on ``u`` samples,
        ``flops`` being the GPU's achieved FLOP/s for layers without a measured curve."""
        t = 0.0
        for c in self.layers[start:stop]:
            t += c.fwd_time(u) if c.fwd_time is not None else c.fwd_flops_per_sample * u / flops
        return t

    def bwd_time(self, start: int, stop: int, u: float, flops: float) -> float:
        """Seconds to recompute layers [start, stop) with autograd and run backward."""
        t = 0.0
        for c in self.layers[start:stop]:
            t += c.bwd_time(u) if c.bwd_time is not None else c.bwd_flops_per_sample * u / flops
        return t

    def update_time(self, start: int, stop: int, cpu_bytes_per_s: float) -> float:
        """CPU optimizer step for layers [start, stop). Measured where known,
        else the bytes the step streams (weights, gradient and every state
        tensor, read and written) over the CPU's optimizer bandwidth."""
        slots = state_slots(self.optimizer)
        # a tied parameter is stepped by its first layer's update
        stepped_elsewhere = {i: 0 for i in range(start, stop)}
        for tie in self.ties:
            for i in tie.layers[1:]:
                if i in stepped_elsewhere:
                    stepped_elsewhere[i] += tie.numel
        t = 0.0
        for i, c in enumerate(self.layers[start:stop], start):
            if c.update_time_s is not None:
                t += c.update_time_s
            else:
                t += (c.param_numel - stepped_elsewhere[i]) * 4 * (3 + 2 * slots) / cpu_bytes_per_s
        return t

    # ---- working memory ----------------------------------------------------
    def fwd_work_bytes(self, start: int, stop: int, u: float) -> float:
        """Transient device bytes of a forward pass without autograd, beyond the
        pack's input and output buffers: layers run one after the other, each
        holding its input (a transient itself inside the pack) and what it makes
        (``fwd_extra``: output and temporaries; the last layer's output is the
        pack's output buffer), so the worst layer counts."""
        worst = 0.0
        for i in range(start, stop):
            held = self.layers[i].fwd_extra(u) + (self.input_bytes(i, u) if i > start else 0.0)
            if i == stop - 1:
                held -= self.input_bytes(stop, u)
            worst = max(worst, held)
        return worst

    def bwd_work_bytes(self, start: int, stop: int, u: float) -> float:
        """Device bytes of recompute + backward of a pack: autograd keeps every
        layer's saved activations until backward reaches it, so they add up
        (the reference packer's conservative estimate). The pack's input is a
        buffer of its own (a layer keeping it adds nothing), and a tensor passed
        from one layer to the next is counted once when both keep it; where the
        layers say which tensors they keep (``LayerCost.kept``), any tensor is
        counted once, however many layers apart keep it (a skip connection)."""
        layers = self.layers
        total = sum(c.bwd_extra(u) for c in layers[start:stop])
        if any(c.kept for c in layers[start:stop]):
            return max(0.0, total - self._kept_twice(start, stop, u))
        total -= layers[start].saved_input(u)
        for i in range(start + 1, stop):
            total -= min(layers[i - 1].saved_output(u), layers[i].saved_input(u))
        return max(0.0, total)

    def _kept_twice(self, start: int, stop: int, u: float) -> float:
        """Bytes the layers [start, stop) count in ``bwd_extra`` beyond what the pack
        holds: tensors of the pack's input (a buffer of its own), and a second
        count of a tensor that an earlier layer of the pack keeps too."""
        counted, twice = set(), 0.0
        for i in range(start, stop):
            for k in self.layers[i].kept:
                tensor = (i - k.back, k.element)
                if tensor[0] < start or tensor in counted:
                    twice += k.nbytes(u)
                counted.add(tensor)
        return twice

    # ---- derived specs -----------------------------------------------------
    def with_dtypes(
        self, param_dtype: str | None = None, act_dtype: str | None = None
    ) -> "ModelSpec":
        """The same model moving weights / activations in other dtypes
        (working-memory curves scale with the activation dtype)."""
        param_dtype = param_dtype or self.param_dtype
        act_dtype = act_dtype or self.act_dtype
        r = dtype_bytes(act_dtype) / dtype_bytes(self.act_dtype)
        layers = tuple(
            replace(
                c,
                fwd_extra=c.fwd_extra.scaled(r),
                bwd_extra=c.bwd_extra.scaled(r),
                saved_input=c.saved_input.scaled(r),
                saved_output=c.saved_output.scaled(r),
                kept=tuple(replace(k, nbytes=k.nbytes.scaled(r)) for k in c.kept),
            )
            for c in self.layers
        )
        return replace(self, layers=layers, param_dtype=param_dtype, act_dtype=act_dtype)

    @property
    def precision(self) -> str:
        """``"fp32"``, or the mixed precision (``"bf16"`` / ``"fp16"``) the spec moves in."""
        names = {v: k for k, v in PRECISION_DTYPES.items()}
        return names.get(self.param_dtype, self.param_dtype)

    def in_precision(self, precision: str) -> "ModelSpec":
        """The same model trained in ``precision``: under mixed precision weights,
        gradients and activations cross the links in the low dtype while the
        host keeps float32 master weights and optimizer state (and BatchNorm
        crosses in float32). Times and FLOPs stay those of the spec: a profile
        measured in float32 (the 1080 Ti references) does not say how much
        faster the GPU computes in bf16, so the plan's compute is conservative."""
        if precision not in PRECISION_DTYPES:
            raise HarmonyError(
                f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}"
            )
        if precision == self.precision:
            return self
        if self.precision != "fp32":
            raise HarmonyError(
                f"model spec {self.name!r} is in {self.precision}; only a float32 spec can be "
                f"turned into another precision (profile the model in {precision} instead)"
            )
        low = PRECISION_DTYPES[precision]
        return replace(
            self.with_dtypes(low, low), master_dtype=self.master_dtype or self.param_dtype
        )

    def with_optimizer(self, optimizer: str) -> "ModelSpec":
        return replace(self, optimizer=optimizer)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "layers": len(self.layers),
            "params": self.num_params,
            "weight_bytes": self.weight_bytes(),
            "optimizer": self.optimizer,
            "optimizer_state_bytes": self.optimizer_state_bytes(),
            "param_dtype": self.param_dtype,
            "act_dtype": self.act_dtype,
            "master_dtype": self.master_dtype or self.param_dtype,
            "source": self.source,
        }
