"""Harmony-DP (VLDB 2022): data-parallel placement.

Every GPU runs every pack, grouped over the microbatches of its share of the
minibatch (see :mod:`.harmony_pp` for grouping and the recompute that does not
wait for the output gradient: here the gradient is mostly on the GPU already,
so it overlaps only what comes through host memory). After a backward pack, the
GPUs reduce-scatter its gradient over the peer links; each GPU sends its
shard (every k-th layer of the pack) to the host and one CPU worker per GPU
updates that shard, so updates run in parallel. (No all-gather is needed: next iteration's
weights come from the host anyway.) A GPU loads a backward pack only once the gradient of
the backward pack ``prefetch_packs`` before it has left, so a GPU ahead of the
others does not pile up gradient accumulators waiting for the exchange.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from .builder import GraphBuilder, Op
from .common import (
    grouped_ops,
    offloaded_bytes,
    reduce_scatter_out,
    replica_shares,
    reuse_gradient_buffers,
    volume,
)

NAME = "harmony-dp"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "harmony"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = True
#: a pack's gradients all reach host memory before the next-but-one pack's first one (packs
#: run grouped over the whole minibatch), so where host memory is short they can be held
#: in slots (harmony.policies.disk_tier)
GRADIENT_WINDOW = True
PER_MICROBATCH = False


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    # tied gradients split per microbatch unless they are reduced across GPUs
    b = GraphBuilder(
        spec, hw, plan, model, split_ties=plan.n_gpus == 1, gradient_window=GRADIENT_WINDOW
    )
    b.run(ops(plan))
    by_pack: dict[int, list] = {}
    for group in b.bwd_groups:
        by_pack.setdefault(group.pack, []).append(group)
    drained: dict[
        int, list[int]
    ] = {}  # gradient buffer -> the shards' G_OUTs after which it is free
    for pack, groups in sorted(by_pack.items(), reverse=True):
        outs = reduce_scatter_out(b, groups)
        for r, (g, out) in enumerate(zip(groups, outs)):
            b.update(pack, g.layers, [out.id], worker=g.gpu, shard=(r, len(groups)))
            drained[g.grad_buffer] = [o.id for o in outs]
    reuse_gradient_buffers(b, drained)  # a GPU ahead of the others does not pile up gradients
    return b.graph(policy=NAME)


def ops(plan: Plan) -> list[Op]:
    """The compute ops, in one global order: step by step, replica by replica."""
    offload = plan.option("offload_activations")
    per_replica = [
        grouped_ops(plan, share, lambda i, r=r: r, lambda i: offload)
        for r, share in enumerate(replica_shares(plan.minibatch, plan.n_gpus))
        if share[1] > share[0]
    ]
    return [op for i in range(len(per_replica[0])) for steps in per_replica for op in steps[i]]


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    k = sum(1 for a, b in replica_shares(plan.minibatch, plan.n_gpus) if b > a)
    return volume(
        spec,
        plan,
        weight_passes=k,
        grad_passes=1,
        via_host=offloaded_bytes(spec, plan),
        reduce=(k - 1) * sum(spec.grad_bytes(*p) for p in plan.bwd_packs),
        tie_passes=len(plan.bwd_microbatches()) if plan.n_gpus == 1 else None,
        disk=disk,
    )
