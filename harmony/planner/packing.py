"""How to cut a chain of layers into packs: per-pack memory estimates, the
microbatch sizes worth trying, and two packers (largest packs under a memory
budget, contiguous packs balanced by cost). The planner and the policies' own
plan choosers share them; estimates only steer a choice, the simulator's
ledger decides whether a plan fits."""

from __future__ import annotations

from typing import Sequence

from ..costs.placement import GRADIENT_SLOTS, STAGED_PACKS
from ..costs.spec import ModelSpec
from ..plan import Pack
from ..policies.state import host_state

#: fractions of GPU memory tried for one pack (double buffering keeps two resident)
BUDGETS = (0.5, 0.3, 0.15)


def microbatch_sizes(limit: int, cap: int | None, smallest: int = 1) -> list[int]:
    """Powers of two up to ``limit`` samples (and ``limit`` itself), at most
    ``cap``, leaving no microbatch of fewer than ``smallest`` samples (the
    model's :attr:`~harmony.costs.spec.ModelSpec.min_microbatch`)."""
    top = min(limit, cap) if cap else limit
    sizes = {1 << i for i in range(top.bit_length()) if (1 << i) <= top}
    sizes.add(top)
    return sorted(u for u in sizes if u >= smallest and not 0 < limit % u < smallest)


def bwd_pack_bytes(spec: ModelSpec, a: int, b: int, u: int) -> float:
    """Estimated device bytes of a backward pack [a, b) on ``u`` samples: weights,
    gradients, recompute + backward working memory, its input (stashed one in
    flight too) and the incoming output gradient."""
    return (
        spec.weight_bytes(a, b)
        + spec.grad_bytes(a, b)
        + spec.bwd_work_bytes(a, b, u)
        + 2 * spec.input_bytes(a, u)
        + spec.input_bytes(b, u)
    )


def fwd_pack_bytes(spec: ModelSpec, a: int, b: int, u: int) -> float:
    return (
        spec.weight_bytes(a, b)
        + spec.fwd_work_bytes(a, b, u)
        + 2 * spec.input_bytes(a, u)
        + spec.input_bytes(b, u)
    )


def greedy_packs(
    spec: ModelSpec, start: int, stop: int, u: int, budget: float, backward: bool
) -> tuple[Pack, ...] | None:
    """Largest packs under ``budget`` bytes each; backward packs fill from the last
    layer. None when a single layer does not fit."""
    size = bwd_pack_bytes if backward else fwd_pack_bytes
    packs: list[Pack] = []
    if backward:
        b = stop
        while b > start:
            a = b - 1
            if size(spec, a, b, u) > budget:
                return None
            while a > start and size(spec, a - 1, b, u) <= budget:
                a -= 1
            packs.append((a, b))
            b = a
        return tuple(reversed(packs))
    a = start
    while a < stop:
        b = a + 1
        if size(spec, a, b, u) > budget:
            return None
        while b < stop and size(spec, a, b + 1, u) <= budget:
            b += 1
        packs.append((a, b))
        a = b
    return tuple(packs)


def balanced_packs(costs: Sequence[float], k: int, offset: int = 0) -> tuple[Pack, ...]:
    """Split ``costs`` into at most ``k`` contiguous packs minimising the largest sum."""
    k = max(1, min(k, len(costs)))
    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(_cut(costs, mid)) <= k:
            hi = mid
        else:
            lo = mid
    return tuple((a + offset, b + offset) for a, b in _cut(costs, hi))


def _cut(costs: Sequence[float], limit: float) -> list[Pack]:
    packs, a, acc = [], 0, 0.0
    for i, c in enumerate(costs):
        if acc + c > limit and i > a:
            packs.append((a, i))
            a, acc = i, 0.0
        acc += c
    packs.append((a, len(costs)))
    return packs


def split_for_staging(
    spec: ModelSpec, packs: tuple[Pack, ...], host_memory: int, window: bool = False
) -> tuple[Pack, ...]:
    """``packs`` with each backward pack cut, greedily, until the
    :data:`~harmony.costs.placement.STAGED_PACKS` copies of its master weights
    and optimizer state a disk tier stages at once fit host memory beside the
    gradients (they stay in host memory): every pack's or, with ``window`` (a
    policy that holds them in slots where host memory is short),
    :data:`~harmony.costs.placement.GRADIENT_SLOTS` of its own. A larger pack
    cannot be placed (:func:`harmony.policies.tier_placement.place` refuses it); a
    single layer over the limit stays whole, for the simulator to refuse.
    Stashes (and tied gradients) also take host memory: the limit is an upper
    bound."""
    whole = host_state(spec, range(len(spec))).gradients

    def fits(a: int, b: int) -> bool:
        state = host_state(spec, range(a, b))
        gradients = GRADIENT_SLOTS * state.gradients if window else whole
        return STAGED_PACKS * (state.weights + state.optimizer) + gradients <= host_memory

    out: list[Pack] = []
    for a, b in packs:
        start = a
        for i in range(a + 1, b):
            if not fits(start, i + 1):
                out.append((start, i))
                start = i
        out.append((start, b))
    return tuple(out)
