"""ZeRO-Offload / ZeRO-Infinity (Ren et al., ATC 2021; Rajbhandari et al., SC 2021).

The published systems are data parallel with ZeRO's partitioning: each of
the k GPUs (ranks) owns 1/k of the optimizer state. ZeRO-Offload keeps the
fp32 master weights, the optimizer state and the Adam step on the CPU: during
backward, gradients are reduce-scattered across the ranks and each rank's
partition is copied to its CPU, which accumulates them over the micro-steps
of gradient accumulation and updates its partition. ZeRO-Infinity also
offloads the parameters: each layer's parameters are fetched to the GPU just
before its forward and again before its backward (prefetched, all-gathered
from the ranks' partitions) and released after; activation checkpoints can
be offloaded to host memory too.

This policy reproduces that pattern: each GPU takes its microbatches one at a
time through the whole model; every pack's weights are fetched for its
forward and again for its backward on every microbatch (prefetched, double
buffered); after each microbatch's backward of a pack the GPUs reduce-scatter
its gradient over the peer links and GPU r sends shard r (every k-th layer of
the pack, summed over the GPUs) to host memory, which adds up the
microbatches; once they are all in, CPU worker r updates shard r: the update
is partitioned across the ranks. A GPU loads a backward pack (weights and
gradient buffer) only once the gradient of its backward pack
``prefetch_packs`` before has been reduced and offloaded, as ZeRO reuses its
gradient buckets. Activation checkpoints are the backward-pack inputs,
stashed to host memory; a pack's recompute waits for its output gradient (no
``overlap_recompute``), as activation checkpointing recomputes when autograd's
backward reaches the checkpoint. The GPUs run in lockstep (a reduce-scatter after
every microbatch), so each one must have the same number of microbatches.
:func:`choose_plan` uses one layer per pack, as ZeRO fetches parameters
module by module and checkpoints every layer.

Where the server has a disk tier and the state does not fit host memory,
the optimizer state and then the master weights of the last packs live on
disk, read around their updates and, for weights, before every load, as
ZeRO-Infinity's NVMe offload does (:mod:`.disk_tier`).

Simplified: each GPU loads a whole pack from host memory, where ZeRO-Infinity
fetches its 1/k partition and all-gathers the rest from the other GPUs, so
the host links carry k times ZeRO's parameter traffic and the peer links
none of it; parameters cross at the spec's dtype (no fp16 copy of fp32
masters); shards are whole layers, not flat partitions; the update runs once
per minibatch (no one-step delayed update). On one GPU the schedule is the
one of :mod:`.harmony_no_grouping`.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import TaskGraph
from ..plan import Plan
from .builder import BwdGroup, GraphBuilder
from .common import (
    check_one_microbatch_size,
    microbatch_ops,
    offloaded_bytes,
    pack_sequence,
    reduce_scatter_out,
    replica_microbatches,
    replica_shares,
    reuse_gradient_buffers,
    volume,
)

NAME = "zero-offload"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
PER_MICROBATCH = True


def lockstep_counts(plan: Plan) -> list[int]:
    """Microbatches per GPU (a GPU without samples counts 0)."""
    counts = [len(mbs) for mbs in replica_microbatches(plan)]
    return counts + [0] * (plan.n_gpus - len(counts))


def microbatches_per_gpu(plan: Plan) -> int:
    """The number of microbatches every GPU runs; a HarmonyError when they differ."""
    check_one_microbatch_size(plan)
    counts = lockstep_counts(plan)
    if len(set(counts)) > 1:
        shares = [b - a for a, b in replica_shares(plan.minibatch, plan.n_gpus)]
        raise HarmonyError(
            "zero-offload runs its GPUs in lockstep (a gradient reduce-scatter after every "
            "microbatch), so every GPU needs the same number of microbatches; minibatch "
            f"{plan.minibatch} over {plan.n_gpus} GPUs gives {shares} samples, i.e. {counts} "
            f"microbatches of {plan.fwd_microbatch}: use a minibatch that is a multiple of n_gpus "
            f"x microbatch ({plan.n_gpus * plan.fwd_microbatch})"
        )
    return counts[0]


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    # tied gradients split per microbatch unless they are reduced across GPUs
    b = GraphBuilder(spec, hw, plan, model, split_ties=plan.n_gpus == 1, overlap_recompute=False)
    offload = plan.option("offload_activations")
    per_replica = replica_microbatches(plan)
    # lockstep: microbatch by microbatch, step by step, GPU by GPU
    b.run(
        [
            op
            for m in range(microbatches_per_gpu(plan))
            for i in range(len(pack_sequence(plan)))
            for r, mbs in enumerate(per_replica)
            for op in microbatch_ops(plan, mbs[m], m, lambda _, r=r: r, lambda _: offload, [i])
        ]
    )
    # one reduce-scatter per pack and microbatch, over the GPUs' gradients of that microbatch
    exchanges: dict[tuple[int, int], list[BwdGroup]] = {}
    for g in b.bwd_groups:
        exchanges.setdefault((g.pack, b.tasks[g.ops[0]].microbatch), []).append(g)
    outs: dict[tuple[int, int], list[int]] = {}  # (pack, shard) -> its G_OUT of every microbatch
    drained: dict[int, list[int]] = {}  # gradient buffer -> the G_OUTs after which it is free
    for (pack, _), groups in exchanges.items():
        shards = reduce_scatter_out(b, groups)
        for r, out in enumerate(shards):
            outs.setdefault((pack, r), []).append(out.id)
        for g in groups:
            drained[g.grad_buffer] = [out.id for out in shards]
    reuse_gradient_buffers(b, drained)  # as ZeRO reuses its gradient buckets
    for (pack, r), ids in sorted(outs.items(), key=lambda item: (-item[0][0], item[0][1])):
        b.update(pack, plan.bwd_packs[pack], ids, worker=r, shard=(r, plan.n_gpus))
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    m, k = microbatches_per_gpu(plan), plan.n_gpus
    return volume(
        spec,
        plan,
        weight_passes=k * m,
        grad_passes=m,
        via_host=offloaded_bytes(spec, plan),
        reduce=m * (k - 1) * spec.grad_bytes(),
        disk=disk,
    )
