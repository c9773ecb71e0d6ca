"""Harmony without input-batch grouping: an ablation, not a published system.

Harmony-DP's schedule with one difference: each microbatch goes through the
whole model on its own, so every pack's weights are swapped in for its
forward and again for its backward *on every microbatch*, and each pack's
gradient goes to the host after every microbatch (the host accumulates; the
accumulation itself is not charged). Everything else is Harmony's: its
planner's packs and microbatch sizes (the search plans it), prefetch (double
buffering), the CPU optimizer overlapped with backward, recompute from stashed
pack inputs that does not wait for the output gradient (``overlap_recompute``).
Over N GPUs it is data parallel: each GPU does this on its share of the
minibatch. What it measures is input-batch grouping alone. (It was called
``virtual-memory``; the systems that virtualize GPU memory as their authors
run them are :mod:`.layer_swap`, :mod:`.gpipe_swap` and :mod:`.karma`.)
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from .builder import GraphBuilder, Op
from .common import (
    check_one_microbatch_size,
    data_parallel_microbatch_ops,
    offloaded_bytes,
    replica_microbatches,
    update_after_gradients,
    volume,
)

NAME = "harmony-no-grouping"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "ablation"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = True
#: each microbatch goes through the whole model on its own (one microbatch size, weights per
#: microbatch)
PER_MICROBATCH = True


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(spec, hw, plan, model)
    b.run(ops(plan))
    update_after_gradients(b)
    return b.graph(policy=NAME)


def ops(plan: Plan) -> list[Op]:
    """The compute ops, in the global order (:func:`.common.data_parallel_microbatch_ops`)."""
    return data_parallel_microbatch_ops(plan)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    check_one_microbatch_size(plan)
    n_mb = sum(len(mbs) for mbs in replica_microbatches(plan))
    return volume(
        spec,
        plan,
        weight_passes=n_mb,
        grad_passes=n_mb,
        via_host=offloaded_bytes(spec, plan),
        disk=disk,
    )
