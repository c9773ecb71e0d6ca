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


def link_rates(hw: Hardware, n_gpus: int) -> tuple[float, float]:
    """(h2d, d2h) bytes/s one GPU gets when ``n_gpus`` of the plan's GPUs copy at
    once: its own link, or its share of the switch uplink if that is smaller."""
    sharing = min(n_gpus, hw.gpus_per_switch)
    return min(hw.h2d, hw.uplink / sharing), min(hw.d2h, hw.uplink / sharing)


def pack_seconds(
    spec: ModelSpec, hw: Hardware, u: int, n_gpus: int, a: int, b: int, fused: bool
) -> float:
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


class _Costs:
    """:func:`pack_seconds`, :func:`~.packing.bwd_pack_bytes` and
    :func:`~.packing.fwd_pack_bytes` of any pack [a, b) at microbatch ``u`` in
    constant time, from per-layer prefix sums (and a range-maximum table for
    forward's working memory, the worst layer's): the dynamic program of
    :func:`model_packs` asks them for every pair of boundaries."""

    def __init__(self, spec: ModelSpec, hw: Hardware, u: int, n_gpus: int):
        L, flops = len(spec), hw.gpu_flops
        self.spec, self.overhead = spec, hw.task_overhead_s
        self.h2d, self.d2h = link_rates(hw, n_gpus)
        self.inp = [spec.input_bytes(i, u) for i in range(L + 1)]
        c = spec.layers
        self.fwd_t = _prefix(spec.fwd_time(i, i + 1, u, flops) for i in range(L))
        self.bwd_t = _prefix(spec.bwd_time(i, i + 1, u, flops) for i in range(L))
        self.extra = _prefix(c[i].bwd_extra(u) for i in range(L))
        self.saved_in = [c[i].saved_input(u) for i in range(L)]
        # a tensor one layer passes to the next, counted once when both keep it
        self.shared = _prefix(
            min(c[i - 1].saved_output(u), self.saved_in[i]) if i else 0.0 for i in range(L)
        )
        # what a layer holds forward; the pack's first layer holds no input of its own
        self.fwd_first = [c[i].fwd_extra(u) for i in range(L)]
        self.fwd_inner = _RangeMax([self.fwd_first[i] + self.inp[i] for i in range(L)])

    def bwd_bytes(self, a: int, b: int) -> float:
        work = (
            (self.extra[b] - self.extra[a])
            - self.saved_in[a]
            - (self.shared[b] - self.shared[a + 1])
        )
        return (
            self.spec.weight_bytes(a, b)
            + self.spec.grad_bytes(a, b)
            + max(0.0, work)
            + 2 * self.inp[a]
            + self.inp[b]
        )

    def fwd_bytes(self, a: int, b: int) -> float:
        # fwd_work_bytes: the worst layer; the last one's output is the pack's output buffer
        last = self.fwd_first[b - 1] + (self.inp[b - 1] if b - 1 > a else 0.0) - self.inp[b]
        first = self.fwd_first[a] if a < b - 1 else 0.0
        work = max(0.0, last, first, self.fwd_inner.max(a + 1, b - 1))
        return self.spec.weight_bytes(a, b) + work + 2 * self.inp[a] + self.inp[b]

    def seconds(self, a: int, b: int, fused: bool) -> float:
        """:func:`pack_seconds`."""
        stash = 0.0 if fused else self.inp[a]
        compute = self.bwd_t[b] - self.bwd_t[a] + self.overhead
        if not fused:
            compute += self.fwd_t[b] - self.fwd_t[a] + self.overhead
        loads = self.spec.weight_bytes(a, b) * (1 if fused else 2) + stash
        out = self.spec.grad_bytes(a, b) + (stash if a > 0 else 0.0)
        return max(compute, loads / self.h2d, out / self.d2h)


def _prefix(values) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


class _RangeMax:
    """The largest of ``values[i:j]`` in constant time (a sparse table); 0 when empty."""

    def __init__(self, values: list[float]):
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2

    def max(self, i: int, j: int) -> float:
        if j <= i:
            return 0.0
        k = (j - i).bit_length() - 1
        level = self.levels[k]
        return max(level[i], level[j - (1 << k)])


def model_packs(
    spec: ModelSpec, hw: Hardware, u: int, n_gpus: int, budget: float
) -> tuple[Pack, ...] | None:
    """The backward packs KARMA's choice makes for microbatches of ``u``: the
    packing with the least total :func:`pack_seconds`, each pack within
    ``budget`` bytes (:func:`~harmony.planner.packing.bwd_pack_bytes`,
    :func:`~harmony.planner.packing.fwd_pack_bytes`), found by dynamic programming
    over where packs start; None when no packing fits. Merging two packs
    never costs time in this model, so it swaps as few boundaries as memory
    allows, and places them where the swap costs least against the compute
    it hides behind."""
    L = len(spec)
    costs = _Costs(spec, hw, u, n_gpus)
    seconds = costs.seconds

    def fits(a: int, b: int, fused: bool) -> bool:
        return costs.bwd_bytes(a, b) <= budget and (fused or costs.fwd_bytes(a, b) <= budget)

    def starts(b: int):
        """Starts of packs ending at ``b``, nearest first, while weights and gradients alone
        fit."""
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
    ends = [
        (best[f] + seconds(f, L, True), f)
        for f in starts(L)
        if best[f] < math.inf and fits(f, L, True)
    ]
    if not ends:
        return None
    b = min(ends)[1]
    packs = [(b, L)]
    while b > 0:
        packs.append((cut[b], b))
        b = cut[b]
    return tuple(reversed(packs))
