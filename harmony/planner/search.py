"""The planner: propose plans, simulate each, keep those that fit, rank by time.

Candidates come from a small grid that covers what matters:

* policy (those in :data:`SEARCHABLE`) and number of GPUs (the caller's lists);
* backward microbatch size ``uB`` (powers of two up to the minibatch, or the
  per-GPU share in data parallel, capped at the largest measured size of a
  profiled model), first each with its largest packs that fit;
* for the best sizes, every backward packing: greedy by memory at several
  fractions of the GPU (filled from the last layer, so the fused pack is as
  large as it can be) and balanced by backward time;
* then, for the best of those, the forward side: forward microbatch size
  ``uF``, forward packs (the backward boundaries, or greedy by memory), and
  whether activations go through host memory.

The stages are a coordinate descent: cheap and good, not exhaustive.

Every candidate is played by the simulator; a plan whose simulated peak
exceeds the GPU memory is never returned (the packers' estimates only steer
the grid, the ledger decides), nor one whose training state and stashes do not
fit the host memory (with its disk tier, where the hardware has one). A plan
whose state spills to the disk tier pays for it in the simulation: its disk
reads and writes are tasks on the disk's links.
"""

from __future__ import annotations

import bisect
import math
import numbers
import time
from dataclasses import dataclass, replace
from typing import Iterable

import pandas as pd

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import HostMemoryError
from ..costs.reference import max_profiled
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, OutOfMemoryError
from ..plan import Pack, Plan
from ..policies import (
    compute_lower_bound,
    get_policy,
    gradient_window,
    names,
    resident,
)
from .packing import (
    BUDGETS,
    balanced_packs,
    bwd_pack_bytes,
    greedy_packs,
    microbatch_sizes,
    split_for_staging,
)
from .pool import Pool

#: what the search compares by default: Harmony's placements and their ablations
DEFAULT_POLICIES = tuple(names("harmony") + names("ablation"))
#: policies the search plans; the others choose their plans themselves (harmony.planner.systems)
SEARCHABLE = tuple(names(searched=True))


# ---- the search -----------------------------------------------------------------
@dataclass
class _Candidate:
    plan: Plan
    stage: str


def _min_layer_bytes(spec: ModelSpec) -> tuple[int, float]:
    """The layer that needs the most memory at the smallest microbatch, and how much."""
    u = spec.min_microbatch
    worst = max(range(len(spec)), key=lambda i: bwd_pack_bytes(spec, i, i + 1, u))
    return worst, bwd_pack_bytes(spec, worst, worst + 1, u)


def search(
    spec: ModelSpec,
    hardware: Hardware,
    minibatch_size: int,
    policies: Iterable[str] = DEFAULT_POLICIES,
    n_gpus: Iterable[int] | int | None = None,
    top_k: int = 2,
    progress: bool = False,
    workers: int | None = None,
    equal_microbatches: bool = False,
    precision: str | None = None,
    prune: bool = False,
) -> pd.DataFrame:
    """Rank plans for ``spec`` on ``hardware`` by simulated iteration time.

    Returns one row per simulated candidate that fits in GPU memory, fastest
    first, with the :class:`Plan` in column ``plan``. ``df.attrs`` holds the
    search time and how many candidates were simulated and rejected (with
    ``prune``, ``"pruned"``: how many were skipped).
    ``workers`` processes simulate in parallel (default: one per core, at most 4).
    ``equal_microbatches``: only plans whose forward and backward microbatch
    sizes are equal (what a model with dropout or BatchNorm needs to train
    exactly; the engine refuses other plans for it). ``precision``: plan a run
    in ``"fp32"``, ``"bf16"`` or ``"fp16"`` (:meth:`ModelSpec.in_precision`);
    the plans carry it. None: the spec's own, not written in the plans.
    ``prune``: skip a candidate whose compute alone on its busiest GPU (a lower
    bound of its simulated time, :func:`~harmony.policies.compute_lower_bound`)
    exceeds the ``top_k``-th fastest plan its policy and GPU count have found so
    far: it could never be among those the later stages start from, nor among the
    fastest ``top_k`` rows. The rows returned are those simulated: the same
    plans, times and order as without pruning, less some of the slower ones."""
    t0 = time.perf_counter()
    if precision is not None:
        spec = spec.in_precision(precision)
    minibatch_size = _checked_minibatch(minibatch_size)
    policies = _checked_policies(policies)
    gpu_counts = _gpu_counts(hardware, n_gpus)
    worst, need = _check_one_layer_fits(spec, hardware)

    bar = _progress(progress)
    runner = _Runner(Pool(spec, hardware, workers), bar, top_k if prune else None)
    stages = _Stages(spec, hardware, minibatch_size, top_k, equal_microbatches, precision)
    for policy in policies:
        for n in gpu_counts:
            stages.run(runner, policy, n)
    runner.close()
    if not runner.rows and runner.no_host_room and not runner.rejected:
        raise runner.no_host_room[0]
    if not runner.rows:
        raise _no_plan_error(spec, hardware, minibatch_size, runner.rejected, worst, need)
    df = pd.DataFrame(runner.rows).sort_values("iteration_s", kind="stable")
    df = df.reset_index(drop=True)
    df.insert(0, "rank", range(1, len(df) + 1))
    df.attrs.update(
        search_s=time.perf_counter() - t0,
        simulated=len(runner.seen) - runner.pruned,
        rejected_memory=runner.rejected,
        rejected_host_memory=len(runner.no_host_room),
        model=spec.name,
        hardware=hardware.name,
        minibatch=minibatch_size,
    )
    if prune:
        df.attrs["pruned"] = runner.pruned
    return df


def _checked_minibatch(minibatch_size) -> int:
    if (
        not isinstance(minibatch_size, numbers.Integral)
        or isinstance(minibatch_size, bool)
        or minibatch_size < 1
    ):
        raise HarmonyError(f"minibatch size must be a positive integer, got {minibatch_size!r}")
    return int(minibatch_size)


def _checked_policies(policies: Iterable[str]) -> list[str]:
    policies = list(policies)
    for p in policies:
        if get_policy(p).NAME not in SEARCHABLE:
            raise HarmonyError(
                f"the search plans {', '.join(SEARCHABLE)}; for {p} use "
                f"harmony.planner.plan_for({p!r}, ...)"
            )
    return policies


def _gpu_counts(hardware: Hardware, n_gpus: Iterable[int] | int | None) -> list[int]:
    if n_gpus is None:
        gpu_counts = [hardware.n_gpus]
    else:
        gpu_counts = [n_gpus] if isinstance(n_gpus, int) else list(n_gpus)
    for n in gpu_counts:
        if not 1 <= n <= hardware.n_gpus:
            raise HarmonyError(
                f"n_gpus={n} is outside 1..{hardware.n_gpus} for hardware {hardware.name!r}"
            )
    return gpu_counts


def _check_one_layer_fits(spec: ModelSpec, hardware: Hardware) -> tuple[int, float]:
    """The most demanding layer and its backward bytes; an error if it alone does
    not fit one GPU."""
    worst, need = _min_layer_bytes(spec)
    if need > hardware.gpu_memory:
        raise OutOfMemoryError(
            f"layer {worst} ({spec.layers[worst].name}) alone needs {format_bytes(need)} for "
            f"backward at microbatch {spec.min_microbatch} (weights, gradients, activations), "
            f"more than the {format_bytes(hardware.gpu_memory)} of one GPU of {hardware.name!r}: "
            "no plan can fit; split that layer or use bigger GPUs"
        )
    return worst, need


def _no_plan_error(
    spec: ModelSpec,
    hardware: Hardware,
    minibatch_size: int,
    rejected: int,
    worst: int,
    need: float,
) -> OutOfMemoryError:
    tried = (
        f"{rejected} candidates simulated, all over capacity"
        if rejected
        else "no packing of the layers fits the planner's per-pack budget"
    )
    return OutOfMemoryError(
        f"no plan for {spec.name} at minibatch {minibatch_size} fits in "
        f"{format_bytes(hardware.gpu_memory)} per GPU ({tried}); the most demanding layer, "
        f"{worst} ({spec.layers[worst].name}), needs {format_bytes(need)} for backward at "
        f"microbatch {spec.min_microbatch}. Use GPUs with more memory or split that layer."
    )


class _Runner:
    """Simulates candidates not seen before, keeps the rows of those that fit, and
    counts those that do not (over GPU memory, or their state over the host's).
    With ``prune_k``, skips (and counts) those that cannot beat the ``prune_k``-th
    fastest of their rivals."""

    def __init__(self, pool: Pool, bar, prune_k: int | None = None) -> None:
        self.pool, self.bar, self.prune_k = pool, bar, prune_k
        self.rows: list[dict] = []
        self.seen: set[Plan] = set()
        self.rejected = 0
        self.pruned = 0
        self.no_host_room: list[HostMemoryError] = []

    def run(self, cands: list[_Candidate], rivals: list[dict] = ()) -> list[dict]:
        """The rows of the new candidates among ``cands`` that fit, in their order
        (``rivals``: the rows found so far that these candidates compete with)."""
        fresh = []
        for c in cands:
            if c.plan not in self.seen:
                self.seen.add(c.plan)
                fresh.append(c)
        plans = [c.plan for c in fresh]
        if self.prune_k is None:
            summaries = self.pool.map(plans)
        else:
            summaries = self._map_pruned(plans, [r["iteration_s"] for r in rivals])
        out = []
        for c, s in zip(fresh, summaries):
            if s is None:
                self.pruned += 1
                continue
            self.bar.update(1)
            if isinstance(s, HostMemoryError):
                self.no_host_room.append(s)
                continue
            if not s.fits:
                self.rejected += 1
                continue
            out.append(_row(c, s))
        self.rows.extend(out)
        return out

    def _map_pruned(self, plans: list[Plan], times: list[float]) -> list:
        """The summaries of ``plans``, None for those skipped. Simulated in waves of
        one plan per worker, those with the least lower bound first; a plan is
        skipped once its bound exceeds the ``prune_k``-th fastest time of those
        that fit among ``times`` (the rivals') and the waves before. Then at least
        ``prune_k`` plans that fit are faster, so it is in no stage's fastest
        ``prune_k``, whatever is found later."""
        k, spec, hw = self.prune_k, self.pool.spec, self.pool.hw
        bounds = [compute_lower_bound(spec, hw, p) for p in plans]
        # a plan without a bound cannot be ruled out: first, with the rest
        order = sorted(
            range(len(plans)), key=lambda i: -math.inf if bounds[i] is None else bounds[i]
        )
        times = sorted(times)
        out: list = [None] * len(plans)
        for at in range(0, len(order), self.pool.workers):
            bar = times[k - 1] if len(times) >= k else math.inf
            wave = [
                i
                for i in order[at : at + self.pool.workers]
                if bounds[i] is None or bounds[i] <= bar
            ]
            if not wave:
                break  # by bound: those after these are ruled out too
            for i, s in zip(wave, self.pool.map([plans[i] for i in wave])):
                out[i] = s
                if not isinstance(s, HostMemoryError) and s.fits:
                    bisect.insort(times, s.iteration_s)
        return out

    def close(self) -> None:
        self.bar.close()
        self.pool.close()


@dataclass
class _Stages:
    """The search's stages for one policy on ``n`` GPUs (the module docstring's)."""

    spec: ModelSpec
    hardware: Hardware
    minibatch_size: int
    top_k: int
    equal_microbatches: bool
    precision: str | None

    def __post_init__(self) -> None:
        self.fcap, self.bcap = max_profiled(self.spec)

    def run(self, runner: _Runner, policy: str, n: int) -> None:
        if policy == resident.NAME:
            runner.run(self.resident(n))
            return
        spec, top_k, fcap, bcap = self.spec, self.top_k, self.fcap, self.bcap
        share = -(-self.minibatch_size // n) if policy != "harmony-pp" else self.minibatch_size
        # Stage A: the backward microbatch size, with the largest packs that fit ...
        packings = {
            ub: _bwd_packings(spec, ub, self.hardware, n, policy)
            for ub in microbatch_sizes(share, bcap, spec.min_microbatch)
        }
        found = runner.run(
            [self.plan_for(policy, n, ub, ps[0]) for ub, ps in packings.items() if ps]
        )
        # ... then every backward packing for the best sizes.
        sizes = [r["plan"].bwd_microbatch for r in _fastest(found, top_k)]
        found += runner.run(
            [self.plan_for(policy, n, ub, bwd) for ub in sizes for bwd in packings[ub][1:]],
            found,
        )
        # Stage B: the forward side around the best backward choices ...
        found += runner.run(self.forward_side(policy, share, fcap, _fastest(found, top_k)), found)
        # ... and activations through host memory for the best plans, where that changes
        # anything.
        if _offload_matters(policy, n):
            runner.run([_offloading(r["plan"]) for r in _fastest(found, top_k)], found)

    def plan_for(
        self, policy: str, n: int, ub: int, packing: tuple[tuple[Pack, ...], dict]
    ) -> _Candidate:
        """A stage A candidate: forward packs on the backward boundaries, uF = uB."""
        bwd, options = packing
        if self.precision is not None:
            options = {**options, "precision": self.precision}
        return _Candidate(
            Plan(policy, n, self.minibatch_size, ub, ub, bwd[:-1], bwd, options), "A"
        )

    def resident(self, n: int) -> list[_Candidate]:
        """The plain loop on one GPU (:mod:`~harmony.policies.resident`) at every
        microbatch size; the simulator's ledger rejects those that do not fit."""
        if n != 1:
            return []
        options = {} if self.precision is None else {"precision": self.precision}
        sizes = microbatch_sizes(self.minibatch_size, self.bcap, self.spec.min_microbatch)
        plans = [
            resident.plan_for(len(self.spec), self.minibatch_size, u, **options) for u in sizes
        ]
        return [_Candidate(p, "A") for p in plans]

    def forward_side(
        self, policy: str, share: int, fcap: int | None, best: list[dict]
    ) -> list[_Candidate]:
        """Stage B: forward microbatch sizes and forward packs for the ``best`` rows."""
        stage_b = []
        for r in best:
            p: Plan = r["plan"]
            # Forward needs no autograd memory, so only sizes >= uB are worth trying.
            ufs = [
                u
                for u in microbatch_sizes(share, fcap, self.spec.min_microbatch)
                if u >= p.bwd_microbatch
            ]
            one_size = get_policy(policy).PER_MICROBATCH or self.equal_microbatches
            for uf in [p.bwd_microbatch] if one_size else ufs:
                for fwd in _fwd_packings(self.spec, p, uf, self.hardware):
                    stage_b.append(_Candidate(replace(p, fwd_microbatch=uf, fwd_packs=fwd), "B"))
        return stage_b


def _offloading(plan: Plan) -> _Candidate:
    """A stage C candidate: ``plan`` with its activations through host memory."""
    return _Candidate(
        replace(plan, options={**dict(plan.options), "offload_activations": True}), "C"
    )


def _bwd_packings(
    spec: ModelSpec, u: int, hw: Hardware, n: int, policy: str
) -> list[tuple[tuple[Pack, ...], dict]]:
    """Backward packings for microbatch ``u``, largest packs first, with the plan
    options they need."""
    L = len(spec)
    times = [spec.bwd_time(i, i + 1, u, hw.gpu_flops) for i in range(L)]
    out: list[tuple[tuple[Pack, ...], dict]] = []
    for frac in BUDGETS:
        packs = greedy_packs(spec, 0, L, u, frac * hw.gpu_memory, backward=True)
        if packs is None:
            continue
        out.append((packs, {}))
        # The same number of packs, balanced by backward time (evens out a pipeline).
        for k in sorted({len(packs), -(-len(packs) // n) * n}):
            out.append((balanced_packs(times, k), {}))
    if not out:
        # Some layer needs more than half the GPU: no room to prefetch the next
        # pack's weights, so load them only after the current pack is done.
        packs = greedy_packs(spec, 0, L, u, 0.95 * hw.gpu_memory, backward=True)
        if packs is not None:
            out.append((packs, {"prefetch_packs": 1}))
    if hw.has_disk:  # packs whose state is too big to stage can never be placed
        # and a layer per pack stages least: what fits the smallest host memory (a large
        # embedding kept in host memory beside the others' state on disk)
        out.append((tuple((i, i + 1) for i in range(L)), {}))
        window = gradient_window(policy)
        out = [(split_for_staging(spec, packs, hw.host_memory, window), o) for packs, o in out]
    unique = {(packs, tuple(sorted(o.items()))): (packs, o) for packs, o in out}
    return list(unique.values())


def _fwd_packings(spec: ModelSpec, plan: Plan, u: int, hw: Hardware) -> list[tuple[Pack, ...]]:
    stop = plan.bwd_packs[-1][0]
    if stop == 0:
        return [()]
    out = [plan.bwd_packs[:-1]]
    for frac in BUDGETS:
        packs = greedy_packs(spec, 0, stop, u, frac * hw.gpu_memory, backward=False)
        if packs is not None:
            out.append(packs)
    return list(dict.fromkeys(out))


def _fastest(rows: list[dict], k: int) -> list[dict]:
    return sorted(rows, key=lambda r: r["iteration_s"])[:k]


def _offload_matters(policy: str, n: int) -> bool:
    """Offloading activations only changes plans whose consecutive packs share a GPU."""
    return not (policy == "harmony-pp" and n > 1)


def _row(c: _Candidate, s: dict) -> dict:
    p = c.plan
    return {
        "policy": p.policy,
        "n_gpus": p.n_gpus,
        "fwd_microbatch": p.fwd_microbatch,
        "bwd_microbatch": p.bwd_microbatch,
        "fwd_packs": len(p.fwd_packs),
        "bwd_packs": len(p.bwd_packs),
        "offload_activations": p.option("offload_activations"),
        "iteration_s": s.iteration_s,
        "samples_per_s": s.samples_per_s,
        "peak_memory_gb": max(s.peak_memory.values()) / 1e9,
        "swap_gb": s.swap_bytes / 1e9,
        "disk_gb": s.disk_bytes / 1e9,
        "p2p_gb": (s.bytes_by_kind.get("P2P", 0.0) + s.bytes_by_kind.get("REDUCE", 0.0)) / 1e9,
        "lower_bound_s": s.lower_bound_s,
        "limited_by": s.lower_bound_by,
        "stage": c.stage,
        "plan": p,
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(desc="simulating plans", unit="plan")
