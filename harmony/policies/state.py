"""The training state a pack's update steps: which parameters belong to it, and
their bytes in host memory per kind (master weights, gradients, optimizer
state), layer by layer so that a shard of a pack adds up exactly."""

from __future__ import annotations

from typing import Iterable

from ..costs.placement import PackBytes
from ..costs.spec import ModelSpec, dtype_bytes, state_slots


def stepped_numel(spec: ModelSpec, start: int, stop: int) -> int:
    """Parameters whose optimizer step belongs to layers [start, stop): a tied
    parameter is stepped with its first layer."""
    n = sum(c.param_numel for c in spec.layers[start:stop])
    for tie in spec.ties:
        n -= tie.numel * sum(1 for i in tie.layers[1:] if start <= i < stop)
    return n


def host_state(spec: ModelSpec, layers: Iterable[int]) -> PackBytes:
    """Host bytes of the state of ``layers``' stepped parameters: master weights and
    their gradients in the master dtype (the host's copies; float32 under mixed
    precision), the optimizer's float32 slots. Buffers (BatchNorm statistics)
    are not training state: they stay with the model."""
    n = sum(stepped_numel(spec, i, i + 1) for i in layers)
    master = dtype_bytes(spec.master_dtype or spec.param_dtype)
    return PackBytes(
        weights=n * master,
        gradients=n * master,
        optimizer=n * 4 * state_slots(spec.optimizer),
    )
