"""KARMA (Wahib et al., SC 2020): out-of-core training that mixes swapping with recompute.

The published system trains models larger than GPU memory one minibatch at a
time per GPU: layers and their activations are swapped between host and GPU
memory with prefetching, and for each block of layers a performance model
decides whether the block's activations are swapped out to host memory and
back for backward, or dropped and recomputed, so that swapping hides behind
compute. Across nodes it is data parallel, with the gradient exchange
pipelined layer by layer with backward and the weight update on the host
CPU. It reports 1.52x on average over earlier out-of-core methods.

This policy reproduces, in harmony's terms: each microbatch goes through the
whole model on its own (no input-batch grouping): every pack's weights are
swapped in for its forward and again for its backward, with the next pack
prefetched (double buffering); the swap-or-recompute choice is the set of
backward-pack boundaries: a layer that starts a pack has its input swapped
out in forward and back before recompute ("swap"), a layer inside a pack has
its input rebuilt from the pack's first input ("recompute").
:func:`choose_plan` picks those boundaries with the performance model of
:func:`model_packs`. The optimizer state and the update are on the host;
over several GPUs each one takes its share of the minibatch, every
microbatch's gradient goes to host memory where the GPUs' gradients add up,
and a pack's update starts as soon as all of its gradients are in, while
backward goes on (across servers, the engine's distributed mode all-reduces
each pack's gradient as it is done, as KARMA's phased exchange does).

Simplified: harmony's recompute always rebuilds a whole pack from its first
input, so a "swapped" layer is recomputed too (KARMA swaps every activation
of such a layer) and the choice is made at layer boundaries only; the
performance model is the simple one of :func:`model_packs`, not KARMA's; the
schedule is the one of :mod:`.virtual_memory`, KARMA's difference being
which packs it runs.
"""

from __future__ import annotations

import math

from ..graph import TaskGraph
from ..costs.hardware import Hardware
from ..planner.packing import BUDGETS, bwd_pack_bytes, fwd_pack_bytes
from ..plan import Pack, Plan
from ..costs.spec import ModelSpec
from . import virtual_memory
from .common import fastest_fitting

NAME = "karma"
PER_MICROBATCH = True
#: the bytes of the per-microbatch schedule
swap_volume = virtual_memory.swap_volume


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    """The per-microbatch schedule of :mod:`.virtual_memory` on KARMA's packs."""
    graph = virtual_memory.build(spec, hw, plan, model)
    graph.info["policy"] = NAME
    return graph


def link_rates(hw: Hardware, n_gpus: int) -> tuple[float, float]:
    """(h2d, d2h) bytes/s one GPU gets when ``n_gpus`` of the plan's GPUs copy at
    once: its own link, or its share of the switch uplink if that is smaller."""
    sharing = min(n_gpus, hw.gpus_per_switch)
    return min(hw.h2d, hw.uplink / sharing), min(hw.d2h, hw.uplink / sharing)


def pack_seconds(spec: ModelSpec, hw: Hardware, u: int, n_gpus: int, a: int, b: int, fused: bool) -> float:
    """KARMA's performance model, in harmony's terms: seconds per microbatch of
    ``u`` samples of backward pack [a, b) (``fused``: the last one),

        max(compute, h2d bytes / h2d rate, d2h bytes / d2h rate),

    its transfers overlapping its own compute. ``compute`` is its forward
    (none for the fused pack) plus its recompute and backward; ``h2d bytes``
    are its weights, loaded for forward and again for backward (once for the
    fused pack), plus its stashed input coming back; ``d2h bytes`` are its
    gradient plus its input stashed in forward (layer 0's is the minibatch,
    already on the host); the rates are one GPU's share of the links
    (:func:`link_rates`)."""
    h2d, d2h = link_rates(hw, n_gpus)
    stash = 0.0 if fused else spec.input_bytes(a, u)
    compute = spec.bwd_time(a, b, u, hw.gpu_flops) + hw.task_overhead_s
    if not fused:
        compute += spec.fwd_time(a, b, u, hw.gpu_flops) + hw.task_overhead_s
    loads = spec.weight_bytes(a, b) * (1 if fused else 2) + stash
    out = spec.grad_bytes(a, b) + (stash if a > 0 else 0.0)
    return max(compute, loads / h2d, out / d2h)


def model_packs(spec: ModelSpec, hw: Hardware, u: int, n_gpus: int, budget: float) -> tuple[Pack, ...] | None:
    """The backward packs KARMA's choice makes for microbatches of ``u``: the
    packing with the least total :func:`pack_seconds`, each pack within
    ``budget`` bytes (:func:`~harmony.planner.packing.bwd_pack_bytes`,
    :func:`~harmony.planner.packing.fwd_pack_bytes`), found by dynamic programming
    over where packs start; None when no packing fits. Merging two packs
    never costs time in this model, so it swaps as few boundaries as memory
    allows, and places them where the swap costs least against the compute
    it hides behind."""
    L = len(spec)

    def seconds(a: int, b: int, fused: bool) -> float:
        return pack_seconds(spec, hw, u, n_gpus, a, b, fused)

    def fits(a: int, b: int, fused: bool) -> bool:
        return bwd_pack_bytes(spec, a, b, u) <= budget and (fused or fwd_pack_bytes(spec, a, b, u) <= budget)

    def starts(b: int):
        """Starts of packs ending at ``b``, nearest first, while weights and gradients alone fit."""
        for a in range(b - 1, -1, -1):
            if spec.weight_bytes(a, b) + spec.grad_bytes(a, b) > budget:
                return
            yield a

    # best[b]: the cheapest packing of layers [0, b) into packs that are not the fused one
    best, cut = [0.0] + [math.inf] * L, [0] * (L + 1)
    for b in range(1, L):
        for a in starts(b):
            if best[a] < math.inf and fits(a, b, False):
                total = best[a] + seconds(a, b, False)
                if total <= best[b]:  # ties go to the larger pack
                    best[b], cut[b] = total, a
    ends = [(best[f] + seconds(f, L, True), f) for f in starts(L) if best[f] < math.inf and fits(f, L, True)]
    if not ends:
        return None
    b = min(ends)[1]
    packs = [(b, L)]
    while b > 0:
        packs.append((cut[b], b))
        b = cut[b]
    return tuple(reversed(packs))


def choose_plan(spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int, n_gpus: int = 1) -> Plan:
    """KARMA's plan for microbatches of ``microbatch`` on ``n_gpus`` GPUs: the
    packs of :func:`model_packs` at each memory budget of
    :data:`~harmony.planner.packing.BUDGETS`, forward packs on the same boundaries; the
    fastest that fits when simulated."""
    plans = []
    for frac in BUDGETS:
        packs = model_packs(spec, hw, microbatch, n_gpus, frac * hw.gpu_memory)
        if packs is not None:
            plans.append(Plan(NAME, n_gpus, minibatch, microbatch, microbatch, packs[:-1], packs))
    return fastest_fitting(spec, hw, plans, build, NAME)
