"""KARMA's performance model (SC 2020), in harmony's terms: how long a pack takes
per microbatch when its swaps overlap its own compute, and the packing that
minimises the total, found by dynamic programming. The search tries this
packing first for the karma policy; :func:`~harmony.planner.systems.choose_karma`
is KARMA's own choice."""

from __future__ import annotations

import math

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..plan import Pack
from .packing import bwd_pack_bytes, fwd_pack_bytes


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
