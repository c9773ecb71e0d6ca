"""Pieces of schedules that several policies share."""

from __future__ import annotations

from typing import Container, Iterable

from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import (
    ACT_IN,
    ACT_OUT,
    BWD,
    DATA_IN,
    FWD,
    FWDBWD,
    G_OUT,
    P2P,
    REDUCE,
    STASH_IN,
    STASH_OUT,
    W_IN,
    Task,
)
from ..plan import Plan, split_samples
from .builder import BwdGroup, GraphBuilder, Op
from .tier_placement import disk_volume


def replica_shares(minibatch: int, n: int) -> list[tuple[int, int]]:
    """Sample ranges of ``n`` data-parallel replicas, as even as possible."""
    out, at = [], 0
    for r in range(n):
        size = minibatch // n + (1 if r < minibatch % n else 0)
        out.append((at, at + size))
        at += size
    return out


def microbatches(share: tuple[int, int], size: int) -> list[tuple[int, int]]:
    a, b = share
    return [(a + x, a + y) for x, y in split_samples(b - a, size)]


def pack_sequence(plan: Plan) -> list[tuple[str, int]]:
    """Harmony's task order for one minibatch: forward packs, the fused last
    pack, then backward packs from the end: (kind, pack index)."""
    seq = [(FWD, p) for p in range(len(plan.fwd_packs))]
    seq.append((FWDBWD, len(plan.bwd_packs) - 1))
    seq += [(BWD, q) for q in range(len(plan.bwd_packs) - 2, -1, -1)]
    return seq


def grouped_ops(plan: Plan, share: tuple[int, int], gpu_of_step, offload) -> list[list[Op]]:
    """Input-batch grouping: each step of :func:`pack_sequence` runs over every
    microbatch of ``share`` while its weights are resident. Returns one list
    of ops per step. ``gpu_of_step(i)`` places step ``i``; ``offload(i)`` says
    whether step ``i``'s output goes through host memory."""
    steps = []
    for i, (kind, p) in enumerate(pack_sequence(plan)):
        packs, size = (
            (plan.fwd_packs, plan.fwd_microbatch)
            if kind == FWD
            else (plan.bwd_packs, plan.bwd_microbatch)
        )
        gpu, group, off = gpu_of_step(i), ("F" if kind == FWD else "B", p), offload(i)
        steps.append(
            [
                Op(kind, gpu, p, packs[p], mb, m, group, off)
                for m, mb in enumerate(microbatches(share, size))
            ]
        )
    return steps


def boundary_bytes(
    spec: ModelSpec, plan: Plan, samples: int, steps: Container[int] | None = None
) -> float:
    """Bytes crossing pack boundaries once for ``samples`` samples: what step
    ``i`` of :func:`pack_sequence` hands to step ``i + 1`` (activations between
    forward packs and into the fused pack, then activation gradients between
    backward packs), for every step or only for ``steps``."""
    seq = pack_sequence(plan)[:-1]  # the last step (backward of layer 0) hands nothing on
    handed = [
        (plan.fwd_packs[p][1], spec.input_bytes)
        if kind == FWD
        # an activation
        else (plan.bwd_packs[p][0], spec.input_grad_bytes)
        for kind, p in seq
    ]  # ... or its gradient
    return sum(
        size(layer, samples)
        for i, (layer, size) in enumerate(handed)
        if steps is None or i in steps
    )


def stash_bytes(spec: ModelSpec, plan: Plan, samples: int) -> tuple[float, float]:
    """(out, in) bytes of stashed backward-pack inputs; layer 0's input is the
    minibatch itself, already in host memory, so it only comes back in."""
    layers = plan.stash_layers()
    out = sum(spec.input_bytes(layer, samples) for layer in layers if layer > 0)
    back = sum(spec.input_bytes(layer, samples) for layer in layers)
    return out, back


def data_bytes(spec: ModelSpec, samples: int) -> float:
    return spec.input_bytes(0, samples) + spec.target_bytes(samples)


def pack_weight_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Weights loaded by one pass of every forward pack and every backward pack
    (a parameter tied across packs with each)."""
    return sum(spec.weight_bytes(*p) for p in (*plan.fwd_packs, *plan.bwd_packs))


def microbatch_ops(
    plan: Plan,
    samples: tuple[int, int],
    m: int,
    gpu_of_step,
    offload,
    steps: Iterable[int] | None = None,
) -> list[Op]:
    """Microbatch ``m`` (``samples``) through the steps of :func:`pack_sequence`
    (all of them, or ``steps``) *without* input-batch grouping: every op is a
    weight group of its own, so each pack's weights are loaded for this
    microbatch alone. ``gpu_of_step`` and ``offload`` as in :func:`grouped_ops`."""
    seq = pack_sequence(plan)
    ops = []
    for i in range(len(seq)) if steps is None else steps:
        kind, p = seq[i]
        layers = plan.fwd_packs[p] if kind == FWD else plan.bwd_packs[p]
        ops.append(
            Op(
                kind,
                gpu_of_step(i),
                p,
                layers,
                samples,
                m,
                ("F" if kind == FWD else "B", p, m),
                offload(i),
            )
        )
    return ops


def check_one_microbatch_size(plan: Plan) -> None:
    """Refuse a plan with two microbatch sizes for a policy that runs each
    microbatch forward then backward."""
    if plan.fwd_microbatch != plan.bwd_microbatch:
        raise HarmonyError(
            f"{plan.policy} runs each microbatch forward then backward, so fwd_microbatch "
            f"({plan.fwd_microbatch}) must equal bwd_microbatch ({plan.bwd_microbatch})"
        )


def replica_microbatches(plan: Plan) -> list[list[tuple[int, int]]]:
    """The microbatches of each data-parallel replica that has samples."""
    return [
        microbatches(s, plan.fwd_microbatch)
        for s in replica_shares(plan.minibatch, plan.n_gpus)
        if s[1] > s[0]
    ]


def data_parallel_microbatch_ops(plan: Plan) -> list[Op]:
    """Data parallel without grouping: each replica (GPU) takes its microbatches
    one at a time through the whole model (:func:`microbatch_ops`); one global
    order, microbatch by microbatch, replica by replica."""
    check_one_microbatch_size(plan)
    offload = plan.option("offload_activations")
    per_replica = replica_microbatches(plan)
    ops = []
    for m in range(max(len(mbs) for mbs in per_replica)):
        for r, mbs in enumerate(per_replica):
            if m < len(mbs):
                ops += microbatch_ops(plan, mbs[m], m, lambda i, r=r: r, lambda i: offload)
    return ops


def update_after_gradients(b: GraphBuilder) -> None:
    """Every backward group's gradient goes to host memory (the host adds up a
    pack's groups); each pack's CPU update starts once all of them are there.
    Gradient buffers are reused as :func:`reuse_gradient_buffers` says."""
    outs: dict[int, list[int]] = {}
    drained: dict[int, list[int]] = {}
    for group in b.bwd_groups:
        out = b.grad_out(group)
        outs.setdefault(group.pack, []).append(out.id)
        drained[group.grad_buffer] = [out.id]
    reuse_gradient_buffers(b, drained)
    for pack, ids in sorted(outs.items(), reverse=True):
        b.update(pack, b.plan.bwd_packs[pack], ids, worker=pack)


def reuse_gradient_buffers(b: GraphBuilder, drained: dict[int, list[int]]) -> None:
    """On each GPU, a backward group loads its weights and a fresh gradient
    buffer only once the gradient of the backward group ``prefetch_packs``
    before it has left (``drained``: gradient buffer -> the transfers that
    empty it), so a GPU whose gradients leave slower than it computes does not
    pile them up."""
    window = b.plan.option("prefetch_packs")
    loads = {t.io["grads"]: t for t in b.tasks if t.kind == W_IN and "grads" in t.io}
    for gpu in range(b.plan.n_gpus):
        buffers = [g.grad_buffer for g in b.bwd_groups if g.gpu == gpu]
        for earlier, later in zip(buffers, buffers[window:]):
            loads[later].deps = sorted(set(loads[later].deps) | set(drained[earlier]))


def reduce_scatter_out(b: GraphBuilder, groups: list[BwdGroup]) -> list[Task]:
    """Data-parallel exchange of one pack's gradient, accumulated by ``groups``
    (one per GPU): a ring reduce-scatter over the peer links, then GPU ``r``
    sends shard ``r`` of ``k`` (every k-th layer, summed over the GPUs) to host
    memory. Returns the shards' G_OUT tasks, in shard order."""
    k = len(groups)
    done = [g.ops[-1] for g in groups]
    reduce = []
    if k > 1:
        for i, g in enumerate(groups):
            route, rate = b.p2p_route(g.gpu, groups[(i + 1) % k].gpu)
            reduce.append(
                b.transfer(
                    REDUCE,
                    f"gpu{g.gpu}.p2p",
                    f"gpu{g.gpu}",
                    route,
                    (k - 1) / k * b.spec.grad_bytes(*g.layers),
                    done,
                    f"reduce-scatter gradients {g.layers}",
                    max_rate=rate,
                    pack=g.pack,
                    layers=g.layers,
                ).id
            )
    return [
        b.grad_out(g, deps=reduce, shard=(r, k), replicas=groups) for r, g in enumerate(groups)
    ]


def volume(
    spec: ModelSpec,
    plan: Plan,
    *,
    weight_passes: float,
    grad_passes: float,
    p2p: float = 0.0,
    via_host: float = 0.0,
    reduce: float = 0.0,
    tie_passes: float | None = None,
    disk: Placement | None = None,
) -> dict[str, float]:
    """Bytes per transfer kind of one iteration: ``weight_passes`` loads of every
    pack (:func:`pack_weight_bytes`), ``grad_passes`` of every pack's gradient
    out, of which the parameters tied across packs leave ``tie_passes`` times
    (once per microbatch; default ``grad_passes``: their groups are per
    microbatch anyway), the minibatch's stashes and data, ``p2p`` bytes of
    activations between GPUs, ``via_host`` bytes of activations out to host
    memory (and as many back) and ``reduce`` bytes of gradient exchange between
    GPUs; with ``disk``, the plan's placement (:func:`.tier_placement.place`), the
    disk tier's bytes too (:func:`.tier_placement.disk_volume`)."""
    B = plan.minibatch
    stash_out, stash_in = stash_bytes(spec, plan, B)
    grads = sum(
        spec.grad_bytes(*p) for p in plan.bwd_packs
    )  # a parameter tied across packs in each
    split = sum(spec.split_tie_bytes(*p) for p in plan.bwd_packs)
    out = {
        W_IN: weight_passes * pack_weight_bytes(spec, plan),
        G_OUT: grad_passes * (grads - split)
        + (grad_passes if tie_passes is None else tie_passes) * split,
        STASH_OUT: stash_out,
        STASH_IN: stash_in,
        DATA_IN: data_bytes(spec, B),
        P2P: p2p,
        ACT_OUT: via_host,
        ACT_IN: via_host,
        REDUCE: reduce,
    }
    if disk is not None and disk.uses_disk:
        loads = [(p, weight_passes) for p in plan.fwd_packs]
        backward = [(q, weight_passes) for q in range(len(plan.bwd_packs))]
        out.update(disk_volume(spec, plan, disk, loads, backward))
    return out


def offloaded_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Activation bytes through host memory when the plan offloads them all."""
    return (
        boundary_bytes(spec, plan, plan.minibatch) if plan.option("offload_activations") else 0.0
    )
