"""Every system's own plan chooser, and the planner's entry points for any system.

Harmony's placements (and its ablations) are planned by the search
(:mod:`.search`); the other systems choose their plans the way their papers
describe, each by a stated rule written in its chooser's docstring (the
microbatch, for the baselines, by :func:`largest_fitting`: the largest that
fits their own memory, not the fastest);
:func:`plan_for` gives any policy's best plan either way. A chooser
proposes plans; the simulator's memory ledger decides which fit
(:func:`fastest_fitting`), so no chooser returns a plan that runs out of
memory.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import pandas as pd

from ..costs.hardware import Hardware, format_bytes
from ..costs.reference import max_profiled
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, OutOfMemoryError
from ..plan import DEFAULT_OPTIONS, Plan, uniform_packs
from ..policies import POLICIES, get_policy, resident
from ..policies.zero_offload import lockstep_counts
from ..simulate import gc_paused, simulate_graph
from ..trace import Summary
from .karma import model_packs
from .packing import BUDGETS, balanced_packs, greedy_packs, microbatch_sizes
from .search import SEARCHABLE, search


# Whoever shows a chooser's pick needs its numbers again (the explorer's rows and its
# claim, after each change of a control): the summaries simulated lately are kept, a
# few hundred bytes each, so the pick is not simulated a second time. 256: a dozen of
# the explorer's settings (each runs about 20 candidates through its choosers).
@functools.lru_cache(maxsize=256)
def chooser_summary(spec: ModelSpec, hw: Hardware, plan: Plan) -> Summary:
    """The simulated summary of ``plan``'s graph as a chooser sees it (built by its
    policy from ``spec`` as given), kept per (spec, hardware, plan)."""
    with gc_paused():
        return simulate_graph(get_policy(plan.policy).build(spec, hw, plan)).summary


def _none_fits(
    policy: str, spec: ModelSpec, hw: Hardware, leanest: float, tried: int, advice: str
):
    """The OutOfMemoryError of a chooser none of whose ``tried`` candidates fits."""
    why = (
        f"the leanest of {tried} candidates needs {format_bytes(leanest)} at peak"
        if tried
        else "no packing of its layers fits the per-pack memory budget"
    )
    return OutOfMemoryError(
        f"no {policy} plan for {spec.name} fits in the {format_bytes(hw.gpu_memory)} of a GPU "
        f"of {hw.name!r}: {why}; {advice}"
    )


def fastest_fitting(spec: ModelSpec, hw: Hardware, plans: Iterable[Plan], policy: str) -> Plan:
    """The fastest of ``plans`` whose simulated peak fits every GPU: a plan
    chooser proposes, the simulator's memory ledger decides."""
    best, best_s, leanest, tried = None, math.inf, math.inf, 0
    for plan in dict.fromkeys(plans):
        s = chooser_summary(spec, hw, plan)
        tried += 1
        leanest = min(leanest, max(s.peak_memory.values()))
        if s.fits and s.iteration_s < best_s:
            best, best_s = plan, s.iteration_s
    if best is None:
        advice = "use smaller microbatches, more GPUs or GPUs with more memory"
        raise _none_fits(policy, spec, hw, leanest, tried, advice)
    return best


def first_fitting(
    spec: ModelSpec,
    hw: Hardware,
    policy: str,
    sweep: Iterable[Iterable[Plan]],
    stop_early: bool = False,
) -> Plan:
    """Sweep microbatches, keep the largest that fits, else say why: ``sweep``
    gives, per microbatch size from the largest down, the plans to try in
    order; the first whose graph fits every GPU by the simulator's ledger is
    the answer. With ``stop_early`` the sweep ends where a smaller microbatch
    no longer lowers the leanest peak (what is left is not activations). An
    OutOfMemoryError naming the leanest peak when none fits."""
    leanest, tried = math.inf, 0
    for plans in sweep:
        lowest = math.inf
        for plan in plans:
            s = chooser_summary(spec, hw, plan)
            tried += 1
            if s.fits:
                return plan
            lowest = min(lowest, max(s.peak_memory.values()))
        if stop_early and lowest >= leanest:
            break
        leanest = min(leanest, lowest)
    raise _none_fits(policy, spec, hw, leanest, tried, "use more GPUs or GPUs with more memory")


def microbatch_candidates(spec: ModelSpec, share: int, microbatch: int | None) -> list[int]:
    """``[microbatch]`` when one is given, else the sizes a plan chooser tries for
    ``share`` samples per GPU: powers of two, no larger than the spec measured."""
    if microbatch is not None:
        return [microbatch]
    caps = [c for c in max_profiled(spec) if c]
    return microbatch_sizes(share, min(caps) if caps else None, spec.min_microbatch)


def choose_karma(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch: int | None = None,
    n_gpus: int | None = None,
) -> Plan:
    """KARMA's plan on ``n_gpus`` GPUs (default: all of ``hw``, data parallel):
    where to swap and where to recompute is its performance model's choice,
    the packs of :func:`~harmony.planner.karma.model_packs` (forward packs on
    the same boundaries), under the largest memory budget of
    :data:`~harmony.planner.packing.BUDGETS` whose plan fits; the microbatch is
    the largest that fits (``microbatch``, else from the samples per GPU down,
    as :func:`largest_fitting`). The simulator only says what fits: KARMA's
    model, not a search by time, picks the packs."""
    n = hw.n_gpus if n_gpus is None else n_gpus

    def plans_at(u: int) -> Iterator[Plan]:
        for frac in BUDGETS:
            packs = model_packs(spec, hw, u, n, frac * hw.gpu_memory)
            if packs is not None:
                yield Plan("karma", n, minibatch, u, u, packs[:-1], packs)

    sizes = reversed(microbatch_candidates(spec, -(-minibatch // n), microbatch))
    return first_fitting(spec, hw, "karma", (plans_at(u) for u in sizes))


def choose_hydra(
    spec: ModelSpec, hw: Hardware, minibatch: int, microbatch: int | None = None
) -> Plan:
    """HYDRA's shards: for each microbatch size (``microbatch``, or powers of
    two up to the minibatch), the largest shards under each memory budget of
    :data:`~harmony.planner.packing.BUDGETS`, filled from the last layer; the fastest
    plan that fits when simulated."""
    plans = []
    for u in microbatch_candidates(spec, minibatch, microbatch):
        for frac in BUDGETS:
            shards = greedy_packs(spec, 0, len(spec), u, frac * hw.gpu_memory, backward=True)
            if shards is not None:
                plans.append(Plan("hydra", 1, minibatch, u, u, shards[:-1], shards))
    return fastest_fitting(spec, hw, plans, "hydra")


def choose_zero_offload(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch: int | None = None,
    n_gpus: int | None = None,
) -> Plan:
    """ZeRO's plan on ``n_gpus`` GPUs (default: all of ``hw``): one layer per
    pack; the microbatch (``microbatch``, or powers of two up to a GPU's share)
    of the fastest plan that fits when simulated, among those that keep the
    GPUs in lockstep."""
    n = hw.n_gpus if n_gpus is None else n_gpus
    if minibatch % n:
        raise HarmonyError(
            f"zero-offload needs a minibatch divisible by its {n} GPUs (ranks run in lockstep); "
            f"got {minibatch}"
        )
    packs = uniform_packs(0, len(spec), 1)
    plans = [
        Plan("zero-offload", n, minibatch, u, u, packs[:-1], packs)
        for u in microbatch_candidates(spec, minibatch // n, microbatch)
    ]
    lockstep = [p for p in plans if len(set(lockstep_counts(p))) == 1]
    return fastest_fitting(spec, hw, lockstep, "zero-offload")


#: what a swapping baseline does with activations (:func:`checkpoint_packs`)
ACTIVATIONS = ("swap", "recompute")


def checkpoint_packs(spec: ModelSpec, activations: str) -> tuple[tuple[int, int], ...]:
    """Backward packs of a swapping baseline: one layer each when activations
    are swapped (every layer's input goes to host memory and back), or
    checkpoint segments of ceil(sqrt(L)) layers when they are recomputed (Chen
    et al.'s sqrt(n) checkpointing: only each segment's input is swapped; the
    last segment, fused with the loss, is full). The loss is no layer of its
    own to these systems: trailing layers without parameters join the last
    pack (else a pipeline would keep the logits' gradient of every microbatch)."""
    if activations not in ACTIVATIONS:
        raise HarmonyError(
            f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}"
        )
    L = len(spec)
    while L > 1 and spec.layers[L - 1].param_numel == 0:
        L -= 1
    size = 1 if activations == "swap" else math.isqrt(L - 1) + 1
    packs = Plan.uniform("", 1, 1, 1, L, size).bwd_packs
    return packs[:-1] + ((packs[-1][0], len(spec)),)


class PlanMaker(NamedTuple):
    """A baseline's plans: ``plan_at(u)`` at microbatch ``u``, up to ``share``
    samples (a GPU's, or the minibatch for a pipeline)."""

    policy: str
    share: int
    plan_at: Callable[[int], Plan]


def layer_swap_plans(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    n_gpus: int | None = None,
    *,
    activations: str = "swap",
    prefetch: bool = True,
    gpu_optimizer: bool = True,
    gpu_gradients: bool = True,
    policy: str = "layer-swap",
) -> PlanMaker:
    """The plans of a swapping baseline (``policy``) at each microbatch size, on
    ``n_gpus`` GPUs (default: all of ``hw``): forward one layer at a time,
    backward packs by :func:`checkpoint_packs`, the next layer prefetched or
    loaded on demand (``prefetch``), the options as given (those equal to
    their default left out of the plan)."""
    n = hw.n_gpus if n_gpus is None else n_gpus
    bwd = checkpoint_packs(spec, activations)
    fwd = uniform_packs(0, bwd[-1][0], 1)
    chosen = {
        "prefetch_packs": 2 if prefetch else 1,
        "gpu_optimizer": gpu_optimizer,
        "gpu_gradients": gpu_gradients,
    }
    options = {k: v for k, v in chosen.items() if v != DEFAULT_OPTIONS[k]}
    # samples per GPU: data parallel, or a pipeline
    share = -(-minibatch // n) if policy == "layer-swap" else minibatch
    return PlanMaker(policy, share, lambda u: Plan(policy, n, minibatch, u, u, fwd, bwd, options))


def gpipe_swap_plans(
    spec: ModelSpec, hw: Hardware, minibatch: int, n_gpus: int | None = None, **choices
) -> PlanMaker:
    """:func:`layer_swap_plans` for GPipe with swapping: the packs in stages of as
    even a number as possible (:func:`~harmony.policies.gpipe_swap.stages`), on
    at most one GPU per backward pack."""
    packs = checkpoint_packs(spec, choices.get("activations", "swap"))
    n = min(hw.n_gpus if n_gpus is None else n_gpus, len(packs))
    return layer_swap_plans(spec, hw, minibatch, n, policy="gpipe-swap", **choices)


def model_parallel_plans(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    n_gpus: int | None = None,
    *,
    gpu_optimizer: bool = True,
) -> PlanMaker:
    """The plans of model parallelism at each microbatch size: one contiguous
    stage per GPU (``n_gpus``, default all of ``hw``), balanced by the bytes
    each holds: resident weights, gradients and, with ``gpu_optimizer``,
    optimizer state, and what backward keeps at the microbatch (as one splits
    a model by hand to make it fit). An OutOfMemoryError saying so when those bytes alone
    are more than the GPUs hold together."""
    n = min(hw.n_gpus if n_gpus is None else n_gpus, len(spec))
    resident = [
        spec.weight_bytes(i, i + 1)
        + spec.grad_bytes(i, i + 1)
        + (spec.optimizer_state_bytes(i, i + 1) if gpu_optimizer else 0)
        for i in range(len(spec))
    ]
    if sum(resident) > n * hw.gpu_memory:
        what = (
            "weights, gradients and optimizer state" if gpu_optimizer else "weights and gradients"
        )
        raise OutOfMemoryError(
            f"model-parallel keeps every layer's {what} on the GPUs, and {spec.name} does not "
            f"fit: it needs {format_bytes(sum(resident))} resident, more than the {n} GPUs of "
            f"{hw.name!r} hold together ({n} x {format_bytes(hw.gpu_memory)}); use a system "
            "that swaps (harmony-pp, harmony-dp, layer-swap) or more GPUs"
        )
    options = {"gpu_optimizer": True} if gpu_optimizer else {}

    def plan_at(u: int) -> Plan:
        # a stage holds its layers' state and, in backward, what autograd keeps of them
        held = [
            r + spec.bwd_work_bytes(i, i + 1, u) + spec.input_bytes(i, u)
            for i, r in enumerate(resident)
        ]
        packs = balanced_packs(held, n)
        return Plan("model-parallel", len(packs), minibatch, u, u, packs[:-1], packs, options)

    return PlanMaker("model-parallel", minibatch, plan_at)


def resident_plans(
    spec: ModelSpec, hw: Hardware, minibatch: int, n_gpus: int | None = None
) -> PlanMaker:
    """The plain loop on one GPU (:mod:`~harmony.policies.resident`, whatever
    ``n_gpus``) at each microbatch size."""
    return PlanMaker(
        resident.NAME, minibatch, lambda u: resident.plan_for(len(spec), minibatch, u)
    )


#: the baselines whose microbatch follows :func:`largest_fitting`: policy -> its plans
PLAN_MAKERS: dict[str, Callable[..., PlanMaker]] = {
    "layer-swap": layer_swap_plans,
    "gpipe-swap": gpipe_swap_plans,
    "model-parallel": model_parallel_plans,
    "resident": resident_plans,
}


def largest_fitting(
    spec: ModelSpec, hw: Hardware, plans: PlanMaker, microbatch: int | None = None
) -> Plan:
    """The stated microbatch rule of the baselines: of ``plans``, the one with
    the largest microbatch (powers of two up to the samples per GPU, and that
    number itself, as :func:`microbatch_candidates` lists them; or
    ``microbatch``) whose graph fits every GPU by the simulator's ledger. That
    is the baseline's own memory, and what a user of such a system finds by
    trying sizes; not the fastest size, which a search would pick."""
    sizes = reversed(microbatch_candidates(spec, plans.share, microbatch))
    sweep = ([plans.plan_at(u)] for u in sizes)
    return first_fitting(spec, hw, plans.policy, sweep, stop_early=True)


def choose_by_rule(
    policy: str,
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch: int | None = None,
    n_gpus: int | None = None,
    **choices,
) -> Plan:
    """A baseline of :data:`PLAN_MAKERS` as its system runs it, on ``n_gpus``
    GPUs (default: all of ``hw``): ``policy``'s plans with its ``choices``, at
    the microbatch of :func:`largest_fitting` (or ``microbatch``)."""
    plans = PLAN_MAKERS[policy](spec, hw, minibatch, n_gpus, **choices)
    return largest_fitting(spec, hw, plans, microbatch)


#: The per-layer swapping baseline (vDNN / LMS) as such a system runs it (data
#: parallel over several GPUs): :func:`layer_swap_plans` with its ``choices``
#: (by default activations swapped, the next layer prefetched, gradient sums and
#: the optimizer on the GPU) by :func:`choose_by_rule`.
choose_layer_swap = functools.partial(choose_by_rule, "layer-swap")
#: GPipe with per-layer swapping: :func:`gpipe_swap_plans` (the packs and
#: choices of :func:`choose_layer_swap` in pipeline stages) by :func:`choose_by_rule`.
choose_gpipe_swap = functools.partial(choose_by_rule, "gpipe-swap")


def choose_model_parallel(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch: int | None = None,
    n_gpus: int | None = None,
    *,
    gpu_optimizer: bool = True,
) -> Plan:
    """Model parallelism as HYDRA compares against it: :func:`model_parallel_plans`
    (one balanced stage per GPU; weights, gradients and optimizer state resident) at the
    microbatch of :func:`largest_fitting`. An OutOfMemoryError saying so when
    the model does not fit the GPUs' memory together, or not with activations."""
    try:
        return choose_by_rule(
            "model-parallel", spec, hw, minibatch, microbatch, n_gpus, gpu_optimizer=gpu_optimizer
        )
    except OutOfMemoryError as err:
        raise OutOfMemoryError(
            f"model-parallel keeps the whole model resident, one stage per "
            f"GPU: {spec.name}'s weights, gradients and state fit the GPUs "
            f"together, but not with activations ({err})"
        ) from None


def microbatch_sweep(
    policy: str, spec: ModelSpec, hw: Hardware, minibatch: int, **choices
) -> pd.DataFrame:
    """Every microbatch size :func:`largest_fitting` considers for ``policy``
    (one of :data:`PLAN_MAKERS`, with its ``choices``), simulated: microbatch,
    fits, peak_gb, iteration_s, samples_per_s, swap_gb, the plan, and
    ``chosen``: the size the rule picks (the largest that fits), to see what
    the rule costs against the fastest size."""
    if policy not in PLAN_MAKERS:
        raise HarmonyError(f"microbatch_sweep covers {', '.join(PLAN_MAKERS)}; got {policy!r}")
    plans = PLAN_MAKERS[policy](spec, hw, minibatch, **choices)
    rows = []
    for u in microbatch_candidates(spec, plans.share, None):
        plan = plans.plan_at(u)
        s = chooser_summary(spec, hw, plan)
        rows.append(
            {
                "microbatch": u,
                "fits": s.fits,
                "peak_gb": max(s.peak_memory.values()) / 1e9,
                "iteration_s": s.iteration_s,
                "samples_per_s": s.samples_per_s,
                "swap_gb": s.swap_bytes / 1e9,
                "plan": plan,
            }
        )
    df = pd.DataFrame(rows)
    fitting = df.microbatch[df.fits]
    df["chosen"] = df.microbatch == (fitting.max() if len(fitting) else -1)
    return df


#: each system's own chooser: (spec, hw, minibatch) -> its plan
CHOOSERS = {
    "karma": choose_karma,
    "hydra": choose_hydra,
    "zero-offload": choose_zero_offload,
    "gpipe-swap": choose_gpipe_swap,
    "layer-swap": choose_layer_swap,
    "model-parallel": choose_model_parallel,
    "resident": functools.partial(choose_by_rule, "resident"),
}


def plan_for(
    policy: str, spec: ModelSpec, hw: Hardware, minibatch: int, workers: int | None = None
) -> Plan:
    """The best plan of ``policy`` for ``spec`` on ``hw``: the search's where it
    plans the policy (:data:`~harmony.planner.search.SEARCHABLE`), else the
    system's own chooser (:data:`CHOOSERS`)."""
    return plans_for([policy], spec, hw, minibatch, workers)[policy]


def plans_for(
    policies: Sequence[str] | None,
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    workers: int | None = None,
) -> dict[str, Plan]:
    """:func:`plan_for` of each of ``policies`` (default: every registered one,
    leaving out a system whose chooser finds no plan that fits, such as model
    parallelism for a model larger than the GPUs' memory together), the
    searched ones in one search."""
    every = not policies
    policies = list(policies or POLICIES)
    for p in policies:
        get_policy(p)  # an unknown name is said now
    searched = [p for p in policies if p in SEARCHABLE]
    df = search(spec, hw, minibatch, policies=searched, workers=workers) if searched else None
    found = (
        {policy: rows.iloc[0].plan for policy, rows in df.groupby("policy")}
        if df is not None
        else {}
    )
    # every policy: one the search planned none of is left to its chooser, if it has one
    # (resident, the plain loop, runs one GPU of the several a search may plan for)
    missing = [p for p in searched if p not in found and not (every and p in CHOOSERS)]
    if missing:
        raise OutOfMemoryError(f"no {', '.join(missing)} plan for {spec.name} fits on {hw.name!r}")
    for p in policies:
        if p not in found:
            try:
                found[p] = CHOOSERS[p](spec, hw, minibatch)
            except OutOfMemoryError:
                if not every:
                    raise
    return {p: found[p] for p in policies if p in found}
