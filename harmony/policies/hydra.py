"""HYDRA (Nagrecha & Kumar, 2021): model spilling, one model on one GPU.

The published system cuts a model into *shards*, groups of consecutive layers
that each fit in GPU memory, and trains it by moving shards between DRAM and
the GPU: forward shard by shard, then backward shard by shard in reverse,
recomputing a shard's activations from its input; the activations at shard
boundaries are spilled to DRAM; "double buffering" loads the next shard while
the current one computes. On top of spilling it schedules many models at
once (model selection): a hybrid of task and model parallelism with a shard
scheduling heuristic. It reports over 7x against plain model parallelism and
50-100% more throughput than pipeline-parallel tools on multi-model
workloads.

This policy reproduces single-model spilling: the shards are the backward
packs (:func:`choose_plan` takes the largest that fit with two resident); a
shard runs over the whole minibatch while it is on the GPU (in microbatches
when the minibatch does not fit at once), forward, the last shard fused with
the loss and its backward, then backward with recompute from the shard's
input stashed in DRAM; activations and their gradients between shards always
go through host memory, whatever ``offload_activations`` says; double
buffering is ``prefetch_packs`` (2 by default). A shard's recompute waits for
its output gradient (no ``overlap_recompute``): HYDRA runs a shard's backward,
recompute included, through autograd once the gradient is loaded. The graph is for one GPU and
carries the ``model`` index, so multi-model training (``harmony.planner.multi_model``)
can place several of them.

Simplified: HYDRA steps the optimizer on the GPU while a shard is resident
and spills the updated weights and optimizer state back; here, as in every
harmony policy, the update runs on the host CPU from host-resident state, so
a shard's gradient goes out once and nothing is written back. The multi-model
scheduler is not part of this policy. On one GPU, spilling whole shards over
the whole minibatch is Harmony's own single-GPU schedule with activations
offloaded: input-batch grouping and model spilling coincide there.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import TaskGraph
from ..plan import Plan
from .builder import GraphBuilder
from .common import boundary_bytes, grouped_ops, update_after_gradients, volume

NAME = "hydra"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
#: a pack's gradients all reach host memory before the next-but-one pack's first one (packs
#: run grouped over the whole minibatch), so where host memory is short they can be held
#: in slots (harmony.policies.disk_tier)
GRADIENT_WINDOW = True
#: each pack's CPU update (one per pack, not sharded) runs right after the pack's backward:
#: where its master weights are on disk, its backward weight loads take them from the
#: update's read (harmony.policies.disk_tier)
WEIGHTS_WITH_UPDATE = True
PER_MICROBATCH = False


def _check(plan: Plan) -> None:
    if plan.n_gpus != 1:
        raise HarmonyError(
            f"hydra spills one model on one GPU, but the plan asks for {plan.n_gpus} GPUs; train "
            "several models side by side with harmony.train_many, or one model on several GPUs "
            "with harmony-pp, harmony-dp or gpipe-swap"
        )


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    _check(plan)
    b = GraphBuilder(
        spec,
        hw,
        plan,
        model,
        overlap_recompute=False,
        gradient_window=GRADIENT_WINDOW,
        weights_with_update=WEIGHTS_WITH_UPDATE,
    )
    steps = grouped_ops(plan, (0, plan.minibatch), lambda i: 0, lambda i: True)
    b.run([op for step in steps for op in step])
    update_after_gradients(b)
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    _check(plan)
    return volume(
        spec,
        plan,
        weight_passes=1,
        grad_passes=1,
        via_host=boundary_bytes(spec, plan, plan.minibatch),
        tie_passes=len(plan.bwd_microbatches()),
        disk=disk,
    )
