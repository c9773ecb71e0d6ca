"""Every system's own plan chooser, and the planner's entry points for any system.

Harmony's placements (and the per-microbatch ablation) are planned by the
search (:mod:`.search`); the other systems choose their plans the way their
papers describe, each by a stated rule written in its chooser's docstring;
:func:`plan_for` gives any policy's best plan either way. A chooser
proposes plans; the simulator's memory ledger decides which fit
(:func:`fastest_fitting`), so no chooser returns a plan that runs out of
memory.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


from ..costs.hardware import Hardware, format_bytes
from ..costs.reference import max_profiled
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, OutOfMemoryError
from ..plan import Plan, uniform_packs
from ..policies import POLICIES, get_policy
from ..policies.zero_offload import lockstep_counts
from ..simulate import simulate_graph
from .karma import model_packs
from .search import SEARCHABLE, search
from .packing import BUDGETS, balanced_packs, greedy_packs, microbatch_sizes


def fastest_fitting(spec: ModelSpec, hw: Hardware, plans: Iterable[Plan], build, policy: str) -> Plan:
    """The fastest of ``plans`` (built by ``build``) whose simulated peak fits
    every GPU: a plan chooser proposes, the simulator's memory ledger decides."""
    best, best_s, leanest, tried = None, math.inf, math.inf, 0
    for plan in dict.fromkeys(plans):
        s = simulate_graph(build(spec, hw, plan)).summary
        tried += 1
        leanest = min(leanest, max(s.peak_memory.values()))
        if s.fits and s.iteration_s < best_s:
            best, best_s = plan, s.iteration_s
    if best is None:
        why = (f"the leanest of {tried} candidates needs {format_bytes(leanest)} at peak" if tried else
               "no packing of its layers fits the per-pack memory budget")
        raise OutOfMemoryError(
            f"no {policy} plan for {spec.name} fits in the {format_bytes(hw.gpu_memory)} of a GPU of "
            f"{hw.name!r}: {why}; use smaller microbatches, more GPUs or GPUs with more memory"
        )
    return best


def microbatch_candidates(spec: ModelSpec, share: int, microbatch: int | None) -> list[int]:
    """``[microbatch]`` when one is given, else the sizes a plan chooser tries for
    ``share`` samples per GPU: powers of two, no larger than the spec measured."""
    if microbatch is not None:
        return [microbatch]
    caps = [c for c in max_profiled(spec) if c]
    return microbatch_sizes(share, min(caps) if caps else None, spec.min_microbatch)


def choose_karma(spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int, n_gpus: int = 1) -> Plan:
    """KARMA's plan for microbatches of ``microbatch`` on ``n_gpus`` GPUs: the
    packs of :func:`model_packs` at each memory budget of
    :data:`~harmony.planner.packing.BUDGETS`, forward packs on the same boundaries; the
    fastest that fits when simulated."""
    plans = []
    for frac in BUDGETS:
        packs = model_packs(spec, hw, microbatch, n_gpus, frac * hw.gpu_memory)
        if packs is not None:
            plans.append(Plan('karma', n_gpus, minibatch, microbatch, microbatch, packs[:-1], packs))
    return fastest_fitting(spec, hw, plans, get_policy('karma').build, 'karma')


def choose_hydra(spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int | None = None) -> Plan:
    """HYDRA's shards: for each microbatch size (``microbatch``, or powers of
    two up to the minibatch), the largest shards under each memory budget of
    :data:`~harmony.planner.packing.BUDGETS`, filled from the last layer; the fastest
    plan that fits when simulated."""
    plans = []
    for u in microbatch_candidates(spec, minibatch, microbatch):
        for frac in BUDGETS:
            shards = greedy_packs(spec, 0, len(spec), u, frac * hw.gpu_memory, backward=True)
            if shards is not None:
                plans.append(Plan('hydra', 1, minibatch, u, u, shards[:-1], shards))
    return fastest_fitting(spec, hw, plans, get_policy('hydra').build, 'hydra')


def choose_zero_offload(spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int | None = None,
                n_gpus: int | None = None) -> Plan:
    """ZeRO's plan on ``n_gpus`` GPUs (default: all of ``hw``): one layer per
    pack; the microbatch (``microbatch``, or powers of two up to a GPU's share)
    of the fastest plan that fits when simulated, among those that keep the
    GPUs in lockstep."""
    n = hw.n_gpus if n_gpus is None else n_gpus
    if minibatch % n:
        raise HarmonyError(f"zero-offload needs a minibatch divisible by its {n} GPUs (ranks run in lockstep); "
                           f"got {minibatch}")
    packs = uniform_packs(0, len(spec), 1)
    plans = [Plan('zero-offload', n, minibatch, u, u, packs[:-1], packs)
             for u in microbatch_candidates(spec, minibatch // n, microbatch)]
    return fastest_fitting(spec, hw, [p for p in plans if len(set(lockstep_counts(p))) == 1], get_policy('zero-offload').build, 'zero-offload')


def choose_gpipe_swap(spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int | None = None,
                n_gpus: int | None = None) -> Plan:
    """A GPipe-with-swap plan on ``n_gpus`` GPUs (default: all of ``hw``): for
    each microbatch size (``microbatch``, or powers of two up to the
    minibatch) and memory budget of :data:`~harmony.planner.packing.BUDGETS`, the
    largest packs that fit, and as many packs balanced by backward time,
    rounded up to a multiple of the GPUs so that stages hold equal counts;
    the fastest that fits when simulated."""
    n = hw.n_gpus if n_gpus is None else n_gpus
    L = len(spec)
    plans = []
    for u in microbatch_candidates(spec, minibatch, microbatch):
        times = [spec.bwd_time(i, i + 1, u, hw.gpu_flops) for i in range(L)]
        for frac in BUDGETS:
            greedy = greedy_packs(spec, 0, L, u, frac * hw.gpu_memory, backward=True)
            if greedy is None:
                continue
            for packs in (greedy, balanced_packs(times, -(-len(greedy) // n) * n)):
                if len(packs) >= n:
                    plans.append(Plan('gpipe-swap', n, minibatch, u, u, packs[:-1], packs))
    return fastest_fitting(spec, hw, plans, get_policy('gpipe-swap').build, 'gpipe-swap')


#: each system's own chooser: (spec, hw, minibatch) -> its plan
CHOOSERS = {
    "hydra": choose_hydra,
    "zero-offload": choose_zero_offload,
    "gpipe-swap": choose_gpipe_swap,
}


def plan_for(policy: str, spec: ModelSpec, hw: Hardware, minibatch: int, workers: int | None = None) -> Plan:
    """The best plan of ``policy`` for ``spec`` on ``hw``: the search's where it
    plans the policy (:data:`~harmony.planner.search.SEARCHABLE`), else the
    system's own chooser (:data:`CHOOSERS`)."""
    return plans_for([policy], spec, hw, minibatch, workers)[policy]


def plans_for(policies: Sequence[str] | None, spec: ModelSpec, hw: Hardware, minibatch: int,
              workers: int | None = None) -> dict[str, Plan]:
    """:func:`plan_for` of each of ``policies`` (default: every registered one),
    the searched ones in one search."""
    policies = list(policies or POLICIES)
    for p in policies:
        get_policy(p)  # an unknown name is said now
    searched = [p for p in policies if p in SEARCHABLE]
    df = search(spec, hw, minibatch, policies=searched, workers=workers) if searched else None
    found = {policy: rows.iloc[0].plan for policy, rows in df.groupby("policy")} if df is not None else {}
    missing = [p for p in searched if p not in found]
    if missing:
        raise OutOfMemoryError(f"no {', '.join(missing)} plan for {spec.name} fits on {hw.name!r}")
    return {p: found[p] if p in found else CHOOSERS[p](spec, hw, minibatch) for p in policies}
