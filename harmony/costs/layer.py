"""One layer's costs (:class:`LayerCost`), a tensor of the chain it keeps for
backward (:class:`Kept`) and a parameter several layers share (:class:`Tie`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import HarmonyError
from .curve import Curve, is_amount

#: LayerCost's fields that count elements or bytes: integers >= 0
_COUNTS = (
    "param_numel",
    "buffer_numel",
    "norm_param_numel",
    "norm_buffer_numel",
    "fixed_buffer_bytes",
)
#: LayerCost's per-sample sizes and FLOPs: finite numbers >= 0
_PER_SAMPLE = (
    "input_numel_per_sample",
    "input_fixed_bytes_per_sample",
    "fwd_flops_per_sample",
    "bwd_flops_per_sample",
)
#: LayerCost's curves; the time curves may be None (derived from FLOPs)
_CURVES = ("fwd_time", "bwd_time", "fwd_extra", "bwd_extra", "saved_input", "saved_output")


@dataclass(frozen=True)
class Kept:
    """A tensor that passes between layers of the chain and that a layer's
    autograd keeps for backward: made by the layer ``back`` layers before this
    one (0: this layer; the chain's inputs are made ``i + 1`` layers before
    layer ``i``), as element ``element`` of that layer's output, ``nbytes(u)``
    at the spec's activation dtype. A tensor handed along a tuple unchanged
    (a skip connection) is the same tensor in every layer that keeps it, however
    far apart, and a pack holds it once (:meth:`~harmony.costs.spec.ModelSpec.bwd_work_bytes`)."""

    back: int
    element: int
    nbytes: Curve


@dataclass(frozen=True)
class LayerCost:
    """The cost of one layer of a chain.

    Memory curves count what the layer needs *beyond* its weights, its weight
    gradients and its own input: ``fwd_extra(u)`` is the output plus forward
    temporaries without autograd; ``bwd_extra(u)`` is what recompute-and-backward
    keeps (autograd-saved activations, output gradient, input gradient,
    temporaries). Of ``bwd_extra``, ``saved_input(u)`` is the layer's own input
    and ``saved_output(u)`` its own output when autograd keeps
    them: at the first layer of a pack the input is a buffer of its own, and
    between two layers of a pack it is one tensor however many keep it (see
    :meth:`~harmony.costs.spec.ModelSpec.bwd_work_bytes`). ``kept``, where
    known (a described chain), says which tensors of the chain those are, so
    that one a skip connection hands past several layers counts once too. Times: ``fwd_time(u)``
    is forward without autograd; ``bwd_time(u)`` *includes the recompute
    forward* (as the reference profiler measured it). When a time curve is
    ``None`` it is derived from FLOPs and the hardware's FLOP rate.
    """

    name: str
    param_numel: int
    #: float elements of the layer's buffers (BatchNorm statistics, masks)
    buffer_numel: int = 0
    #: of ``param_numel`` and of ``buffer_numel``, BatchNorm's: they cross in the
    #: spec's ``master_dtype`` under mixed precision
    norm_param_numel: int = 0
    norm_buffer_numel: int = 0
    #: bytes of non-float buffers (BatchNorm's batch counter), whatever the dtypes
    fixed_buffer_bytes: int = 0
    #: float elements of the layer's input, per sample (scale with the activation dtype)
    input_numel_per_sample: float = 0.0
    #: bytes of non-float inputs per sample (token ids, masks): fixed whatever the dtype
    input_fixed_bytes_per_sample: float = 0.0
    fwd_flops_per_sample: float = 0.0
    #: recompute forward + backward
    bwd_flops_per_sample: float = 0.0
    fwd_time: Curve | None = None
    bwd_time: Curve | None = None
    #: bytes at the spec's activation dtype
    fwd_extra: Curve = field(default_factory=Curve)
    bwd_extra: Curve = field(default_factory=Curve)
    #: part of bwd_extra: the input, kept by autograd
    saved_input: Curve = field(default_factory=Curve)
    #: part of bwd_extra: the output, kept by autograd
    saved_output: Curve = field(default_factory=Curve)
    #: the tensors of the chain in bwd_extra (empty: unknown, saved_input and saved_output tell)
    kept: tuple[Kept, ...] = ()
    #: measured CPU optimizer step for this layer (s); None: derive from bytes
    update_time_s: float | None = None

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        for name in _COUNTS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise HarmonyError(f"{where}: {name} must be an integer >= 0, got {v!r}")
        for part, whole in (
            ("norm_param_numel", "param_numel"),
            ("norm_buffer_numel", "buffer_numel"),
        ):
            if getattr(self, part) > getattr(self, whole):
                raise HarmonyError(
                    f"{where}: {part} ({getattr(self, part)}) is more than {whole} "
                    f"({getattr(self, whole)})"
                )
        numbers = _PER_SAMPLE + (() if self.update_time_s is None else ("update_time_s",))
        for name in numbers:
            if not is_amount(v := getattr(self, name)):
                raise HarmonyError(f"{where}: {name} must be a finite number >= 0, got {v!r}")
        for name in _CURVES:
            v = getattr(self, name)
            if not isinstance(v, Curve) and not (v is None and name.endswith("time")):
                raise HarmonyError(
                    f"{where}: {name} must be a harmony.Curve, got {type(v).__name__}"
                )
        if not all(isinstance(k, Kept) for k in self.kept):
            raise HarmonyError(f"{where}: kept must be a tuple of harmony.costs.layer.Kept")


@dataclass(frozen=True)
class Tie:
    """A parameter that several layers share (tied weights, e.g. a language
    model's head and its token embedding): the layers, in order, and its number
    of elements, which each of these layers counts in its ``param_numel``. It
    crosses a link once per pack that holds any of these layers, and its
    optimizer step belongs to the first layer's pack."""

    layers: tuple[int, ...]
    numel: int

    def in_range(self, start: int, stop: int) -> int:
        """How many of its layers lie in [start, stop)."""
        return sum(1 for i in self.layers if start <= i < stop)
