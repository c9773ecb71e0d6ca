"""Harmony-PP (VLDB 2022): pipeline placement of layer packs over GPUs.

Each forward pack, the fused last pack and each backward pack runs *grouped*:
over every microbatch of the minibatch while its weights are resident, so the
weights cross the link once per pass whatever the number of microbatches.
Packs go round-robin over the GPUs in task order; activations and their
gradients flow GPU->GPU. A backward pack recomputes each microbatch's forward
as soon as its weights and stashed input are there, while the microbatch's
output gradient is still on its way from the previous pack's GPU (Harmony's
schedule; plan option ``overlap_recompute``). Each pack's gradient leaves the
GPU once, and its CPU update starts as soon as it lands, overlapping the rest
of backward. A pack's weights load as soon as the prefetch window allows,
unless the GPU has no room for them yet (the previous pack's gradient still
leaving, say): then the load waits until enough has been freed (the
simulator's ledger, :mod:`harmony.simulate`, which the engine follows).
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from .builder import GraphBuilder, Op
from .common import boundary_bytes, grouped_ops, volume

NAME = "harmony-pp"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "harmony"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = True
#: a pack's gradients all reach host memory before the next-but-one pack's first one (packs
#: run grouped over the whole minibatch), so where host memory is short they can be held
#: in slots (harmony.policies.disk_tier)
GRADIENT_WINDOW = True
#: each pack's CPU update (one per pack, not sharded) runs right after the pack's backward:
#: where its master weights are on disk, its backward weight loads take them from the
#: update's read (harmony.policies.disk_tier)
WEIGHTS_WITH_UPDATE = True
#: packs run grouped over the microbatches (see harmony.policies.harmony_no_grouping for the
#: opposite)
PER_MICROBATCH = False


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(
        spec,
        hw,
        plan,
        model,
        gradient_window=GRADIENT_WINDOW,
        weights_with_update=WEIGHTS_WITH_UPDATE,
    )
    b.run(ops(plan))
    for group in b.bwd_groups:
        out = b.grad_out(group)
        b.update(group.pack, group.layers, [out.id], worker=group.pack)
    return b.graph(policy=NAME)


def ops(plan: Plan) -> list[Op]:
    """The compute ops, in the global order: step by step, the steps round-robin
    over the GPUs."""
    n = plan.n_gpus
    # Consecutive steps share a GPU only when there is one GPU.
    offload = plan.option("offload_activations") and n == 1
    steps = grouped_ops(plan, (0, plan.minibatch), lambda i: i % n, lambda i: offload)
    return [op for step in steps for op in step]


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    moved = boundary_bytes(spec, plan, plan.minibatch)
    offload = plan.option("offload_activations") and plan.n_gpus == 1
    return volume(
        spec,
        plan,
        weight_passes=1,
        grad_passes=1,
        p2p=moved if plan.n_gpus > 1 else 0.0,
        via_host=moved if offload else 0.0,
        tie_passes=len(plan.bwd_microbatches()),
        disk=disk,
    )
