"""Simulating plans for the explorers: never raising on a setting that cannot
run, but saying in words what is wrong, and one comparison row per policy.

* :func:`play` simulates a plan when it is valid and small enough to be
  interactive (:data:`MAX_TASKS`); a plan whose training state does not fit
  the host's memory (and its disk tier, where it has one) is a problem like
  any other, in the planner's words (:class:`~harmony.costs.placement.HostMemoryError`);
* :func:`played` is :func:`play` kept per model, server and plan;
  :func:`played_summary` its numbers alone; :func:`own_summary` those of a plan
  a baseline's chooser picked (simulated when it was picked, not again); what a
  worker computed of them is put in their :class:`Kept` (:mod:`.row_pool`);
* :func:`server` is a preset with its host memory and disk tier set;
* :func:`own_plan` is the plan a faithful baseline picks by its stated rule
  (:data:`~harmony.planner.systems.PLAN_MAKERS`), as that system would run;
* :func:`row` is what the comparison table shows of a played plan.
"""

from __future__ import annotations

import collections
import functools
import math

import pandas as pd

from ..costs.catalog import model_spec
from ..costs.hardware import Hardware, preset
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..plan import Plan
from ..planner import simulate
from ..planner.systems import CHOOSERS, chooser_summary
from ..trace import Summary, Trace

#: the largest task graph simulated interactively (about a second per policy)
MAX_TASKS = 20_000
#: tasks per compute op (its weight, activation and gradient transfers): 2 to 3.6 measured
TASKS_PER_OP = 4
#: a comparison row's columns, see :class:`~harmony.workbench.widgets.Exploration`
COLUMNS = [
    "policy",
    "chosen",
    "planned_by",
    "fwd_microbatch",
    "bwd_microbatch",
    "iteration_s",
    "samples_per_s",
    "swap_gb",
    "disk_gb",
    "peak_gb",
    "fits",
    "status",
    "note",
]


def estimated_tasks(plan: Plan) -> int:
    """An upper estimate of the tasks in ``plan``'s graph, without building it."""
    fwd = len(plan.fwd_microbatches()) * len(plan.fwd_packs)
    return TASKS_PER_OP * (fwd + len(plan.bwd_microbatches()) * len(plan.bwd_packs))


def over_capacity(summary: Summary) -> list[str]:
    """The devices whose peak exceeds their capacity, the furthest over first."""
    peak, cap = summary.peak_memory, summary.memory_capacity
    return sorted((d for d in cap if peak.get(d, 0.0) > cap[d]), key=lambda d: cap[d] - peak[d])


def out_of_memory(summary: Summary) -> str | None:
    """Which GPU runs out of memory and by how much, or None when the plan fits."""
    peak, cap = summary.peak_memory, summary.memory_capacity
    over = over_capacity(summary)
    if not over:
        return None
    d = over[0]
    also = f"; {', '.join(sorted(over[1:]))} as well" if len(over) > 1 else ""
    return (
        f"{d} runs out of memory: it needs {peak[d] / 1e9:.2f} GB at peak but has "
        f"{cap[d] / 1e9:.2f} GB ({(peak[d] - cap[d]) / 1e9:.2f} GB over){also}. "
        "Try smaller microbatches or packs."
    )


def refusal(spec: ModelSpec, plan: Plan) -> str | None:
    """Why ``plan`` is not simulated here (too large to be interactive), or None;
    an invalid plan raises its HarmonyError."""
    plan.validate(len(spec))
    tasks = estimated_tasks(plan)
    if tasks <= MAX_TASKS:
        return None
    return (
        f"about {tasks:,} tasks ({len(plan.bwd_microbatches())} backward microbatches "
        f"x {len(plan.bwd_packs)} packs, plus forward): more than the {MAX_TASKS:,} "
        "simulated interactively. Use larger microbatches or packs, or "
        "harmony.simulate() in a script."
    )


def play(spec: ModelSpec, hardware: Hardware, plan: Plan) -> tuple[Trace | None, str | None]:
    """Simulate ``plan`` if it is valid and small enough: ``(trace, problem)``.
    The trace is None when the plan could not be simulated (its state does not
    fit host memory included); the problem is None when the plan runs and fits
    in memory."""
    return _run(spec, plan, lambda: simulate(spec, hardware, plan), lambda trace: trace.summary)


def own_summary(
    model: str, source: str, hardware: Hardware, plan: Plan
) -> tuple[Summary | None, str | None]:
    """:func:`played` of a plan :func:`own_plan` picked, as ``(summary, problem)``
    without the trace: the summary its chooser saw when it picked it
    (:func:`~harmony.planner.systems.chooser_summary`), not simulated again; kept
    (:data:`PICKED`), as the worker that ran the chooser found it."""
    spec = cached_spec(model, source)
    return PICKED.get(
        (model, source, hardware, plan),
        lambda: _run(spec, plan, lambda: chooser_summary(spec, hardware, plan), lambda s: s),
    )


def _run(spec: ModelSpec, plan: Plan, simulated, summary_of) -> tuple:
    """``(simulated(), problem)`` unless :func:`refusal` refuses ``plan`` or it raises
    a HarmonyError (then ``(None, why)``); ``summary_of`` finds the summary in what
    ``simulated`` returns, to say whether it runs out of memory."""
    try:
        refused = refusal(spec, plan)
        if refused:
            return None, refused
        result = simulated()
    except HarmonyError as err:
        return None, str(err)
    return result, out_of_memory(summary_of(result))


class Kept:
    """The last ``size`` results, by key: computed on first use (:meth:`get`), or put
    in by whoever computed them elsewhere (:meth:`put`: the explorer's workers,
    :mod:`.row_pool`)."""

    def __init__(self, size: int):
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self.items

    def get(self, key, compute):
        """The value kept for ``key``, else ``compute()``, kept."""
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        return self.put(key, compute())

    def clear(self) -> None:
        self.items.clear()

    def put(self, key, value):
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


@functools.lru_cache(maxsize=32)
def cached_spec(model: str, source: str) -> ModelSpec:
    return model_spec(model, source)


# An explorer re-plays the same plans over and over: a policy change re-orders the rows,
# a baseline's own plan does not change with the packs, and a reader goes back and forth.
# Traces are read, never changed, so one played plan serves every view of it. 64 traces:
# about seven settings of every policy.
TRACES = Kept(64)


def played(
    model: str, source: str, hardware: Hardware, plan: Plan
) -> tuple[Trace | None, str | None]:
    """:func:`play` of ``plan`` on :func:`cached_spec` ``(model, source)``, kept per
    (model, source, hardware, plan) (:data:`TRACES`): each plan is simulated once."""
    key = (model, source, hardware, plan)
    return TRACES.get(key, lambda: play(cached_spec(model, source), hardware, plan))


def server(hardware: str, host_memory: int | None = None, disk: str | None = None) -> Hardware:
    """The preset ``hardware`` with ``host_memory`` bytes of host memory (None: the
    preset's) and ``disk`` under it (a name in :data:`~harmony.costs.hardware.DISKS`
    or ``"<read>,<write>"``, see :meth:`~harmony.costs.hardware.Hardware.with_disk`;
    None: no disk tier)."""
    hw = preset(hardware)
    if host_memory is not None:
        hw = hw.with_host_memory(host_memory)
    return hw.with_disk(disk)


# The controls that do not change a baseline's own plan (pack size, microbatches)
# redraw without re-running its chooser: its plan is kept per setting.
OWN_PLANS = Kept(64)
# What a chooser's pick and a plan on the controls simulate to, by (model, source,
# hardware, plan): a few hundred bytes each, filled by the explorer's workers too.
PICKED = Kept(256)
PLAYED = Kept(256)


def own_plan(
    policy: str,
    model: str,
    source: str,
    hardware: str,
    n_gpus: int,
    minibatch: int,
    host_memory: int | None = None,
    disk: str | None = None,
) -> tuple[Plan | None, str | None]:
    """``(plan, problem)``: the plan ``policy``'s own chooser picks for this
    setting (its packs are what the system is; its microbatch the largest that
    fits) on :func:`server` ``(hardware, host_memory, disk)``, or None and why
    it has none. Kept per setting (:data:`OWN_PLANS`)."""
    key = (policy, model, source, hardware, n_gpus, minibatch, host_memory, disk)
    return OWN_PLANS.get(key, lambda: _choose(*key))


def _choose(policy, model, source, hardware, n_gpus, minibatch, host_memory, disk):
    try:
        spec = cached_spec(model, source)
        hw = server(hardware, host_memory, disk)
        return CHOOSERS[policy](spec, hw, minibatch, n_gpus=n_gpus), None
    except HarmonyError as err:
        return None, str(err)


def played_summary(
    model: str, source: str, hardware: Hardware, plan: Plan
) -> tuple[Summary | None, str | None]:
    """:func:`played` as ``(summary, problem)``: what a worker played of it
    (:data:`PLAYED`), else the summary of the trace kept."""

    def from_trace():
        trace, problem = played(model, source, hardware, plan)
        return (trace.summary if trace is not None else None), problem

    return PLAYED.get((model, source, hardware, plan), from_trace)


def status(summary: Summary | None, problem: str | None) -> str:
    """A row's status in a few words: "fits", "does not fit: <device> needs <GB> more"
    or "not run: <the problem's first sentence>"."""
    if summary is None:
        first = (problem or "").split(". ")[0]
        return "not run: " + (first if len(first) <= 60 else first[:59] + "…")
    over = over_capacity(summary)
    if not over:
        return "fits"
    d = over[0]
    need = (summary.peak_memory[d] - summary.memory_capacity[d]) / 1e9
    return f"does not fit: {d} needs {need:.2f} GB more"


def row(
    policy: str, plan: Plan | None, summary: Summary | None, problem: str | None, **columns
) -> dict:
    """A comparison row of ``policy``'s ``plan`` (None: it has none) as
    played (``summary``: None when it was not), with ``columns`` (``chosen``,
    ``planned_by``) as given."""
    values = {
        "policy": policy,
        **columns,
        "fwd_microbatch": plan.fwd_microbatch if plan else math.nan,
        "bwd_microbatch": plan.bwd_microbatch if plan else math.nan,
        "iteration_s": math.nan,
        "samples_per_s": math.nan,
        "swap_gb": math.nan,
        "disk_gb": math.nan,
        "peak_gb": math.nan,
        "fits": False,
        "status": status(summary, problem),
        "note": problem,
    }
    if summary is not None:
        s = summary
        values.update(
            iteration_s=s.iteration_s,
            samples_per_s=s.samples_per_s,
            swap_gb=s.swap_bytes / 1e9,
            disk_gb=s.disk_bytes / 1e9,
            peak_gb=max(s.peak_memory.values()) / 1e9,
            fits=bool(s.fits),
        )
    return values


def records(df: pd.DataFrame) -> list[dict]:
    """``df``'s rows, JSON-ready (NaN as None)."""
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in df.to_dict("records")
    ]
