"""The simulated figures: every number here comes from playing a plan's task
graph in the simulator, with the GTX 1080 Ti per-layer profiles measured by
the Harmony authors (:func:`harmony.model_spec`) on the paper's servers: the
pack x microbatch grid, the planner's table, scaling, every system, KARMA's and
HYDRA's comparisons (the paper's grid is :mod:`.paper_grid`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import pandas as pd

from ...costs.catalog import model_spec
from ...costs.hardware import preset
from ...costs.reference import max_profiled
from ...errors import HarmonyError, OutOfMemoryError
from ...plan import Plan
from ...planner import plan_for, plans_for, search, simulate
from ...planner.multi_model import Job, compare_schedules, simulate_many
from ...planner.search import SEARCHABLE
from ...planner.systems import CHOOSERS, choose_layer_swap
from ...policies import POLICIES, names
from ...trace import Summary
from .paper_grid import _played, best_plans
from .settings import BASELINE, HARDWARE, HARMONY_POLICIES, hardware_for


def _plan_text(row: pd.Series | None) -> str | None:
    return None if row is None else row["plan"].describe()


def _get(row: pd.Series | None, key: str) -> float:
    return math.nan if row is None else float(row[key])


def pack_microbatch_grid(
    model: str = "bert-large",
    minibatch: int = 64,
    n_gpus: int = 4,
    pack_sizes: Sequence[int] = (1, 2, 4, 7, 14),
    microbatches: Sequence[int] = (1, 2, 4, 8),
    policy: str = "harmony-pp",
    hardware: str = HARDWARE,
) -> pd.DataFrame:
    """Simulated iteration time of ``policy`` for every (layers per backward
    pack, microbatch size) with uF = uB and forward packs on the backward
    boundaries. ``iteration_s`` is NaN where the plan does not fit in GPU memory
    (``status`` says why)."""
    spec = model_spec(model)
    hw = hardware_for(n_gpus, hardware)
    _, cap = max_profiled(spec)
    rows = []
    for size in pack_sizes:
        shape = Plan.uniform(policy, n_gpus, minibatch, 1, len(spec), size)
        for u in microbatches:
            row = {
                "pack_size": size,
                "microbatch": u,
                "packs": len(shape.bwd_packs),
                "iteration_s": math.nan,
                "samples_per_s": math.nan,
                "peak_memory_gb": math.nan,
                "swap_gb": math.nan,
            }
            if u > minibatch:
                row["status"] = "microbatch > minibatch"
            elif cap is not None and u > cap:
                row["status"] = f"not profiled (max {cap})"
            else:
                plan = replace(shape, fwd_microbatch=u, bwd_microbatch=u)
                s = simulate(spec, hw, plan).summary
                peak = max(s.peak_memory.values())
                row.update(
                    peak_memory_gb=peak / 1e9,
                    swap_gb=s.swap_bytes / 1e9,
                    status="ok" if s.fits else "out of memory",
                )
                if s.fits:
                    row.update(iteration_s=s.iteration_s, samples_per_s=s.samples_per_s)
            rows.append(row)
    return pd.DataFrame(rows)


def planner_table(
    models: Sequence[str],
    minibatch: int = 64,
    policy: str = "harmony-pp",
    n_gpus: int = 4,
    hardware: str = HARDWARE,
    workers: int | None = None,
) -> pd.DataFrame:
    """The configuration the search picks for each model, and how long it took
    (column ``plan`` holds the :class:`Plan`, ``plan_text`` its description)."""
    rows = []
    for model in models:
        best = best_plans(
            model, minibatch, hardware, policies=[policy], n_gpus=n_gpus, workers=workers
        )
        r = best.per_policy.get(policy)
        plan: Plan | None = None if r is None else r["plan"]
        rows.append(
            {
                "model": model,
                "layers": len(model_spec(model)),
                "minibatch": minibatch,
                "policy": policy,
                "n_gpus": n_gpus,
                "uF": None if plan is None else plan.fwd_microbatch,
                "uB": None if plan is None else plan.bwd_microbatch,
                "fwd_packs": None if plan is None else len(plan.fwd_packs),
                "bwd_packs": None if plan is None else len(plan.bwd_packs),
                "iteration_s": _get(r, "iteration_s"),
                "samples_per_s": _get(r, "samples_per_s"),
                "peak_memory_gb": _get(r, "peak_memory_gb"),
                "swap_gb": _get(r, "swap_gb"),
                "plans_simulated": best.simulated,
                "search_s": best.search_s,
                "plan_text": None if plan is None else plan.describe(),
                "plan": plan,
            }
        )
    return pd.DataFrame(rows)


def scaling_table(
    models: Sequence[str],
    gpu_counts: Sequence[int],
    minibatch: int,
    policies: Sequence[str] = HARMONY_POLICIES,
    hardware: str = HARDWARE,
    workers: int | None = None,
) -> pd.DataFrame:
    """Best simulated throughput for each GPU count and its scaling efficiency
    ``throughput_N * n0 / (N * throughput_n0)`` against the smallest count n0."""
    rows = []
    counts = sorted(gpu_counts)
    for model in models:
        for n in counts:
            best = best_plans(
                model, minibatch, hardware, policies=policies, n_gpus=n, workers=workers
            )
            r = best.fastest(policies)
            rows.append(
                {
                    "model": model,
                    "n_gpus": n,
                    "hardware": hardware_for(n, hardware).name,
                    "minibatch": minibatch,
                    "policy": None if r is None else r["policy"],
                    "plan": _plan_text(r),
                    "samples_per_s": _get(r, "samples_per_s"),
                    "iteration_s": _get(r, "iteration_s"),
                    "search_s": best.search_s,
                }
            )
    df = pd.DataFrame(rows)
    first = df.groupby("model")["samples_per_s"].transform("first")
    df["speedup"] = df["samples_per_s"] / first
    df["efficiency"] = df["speedup"] * counts[0] / df["n_gpus"]
    return df


def _moved_gb(summary: Summary) -> dict[str, float]:
    kinds = summary.bytes_by_kind
    return {
        "host_gpu_gb": summary.swap_bytes / 1e9,
        "gpu_gpu_gb": (kinds.get("P2P", 0.0) + kinds.get("REDUCE", 0.0)) / 1e9,
    }


def systems_table(
    models: Sequence[str],
    minibatches: Sequence[int],
    hardware: str = HARDWARE,
    policies: Sequence[str] | None = None,
    workers: int | None = None,
) -> pd.DataFrame:
    """Every system's best plan (``policies``, default all; the search's for
    Harmony and its ablations, each other system's own chooser), per model and
    minibatch: its ``microbatch``, ``fits`` and ``reason`` (why a system has no
    plan: model parallelism needs the model in the GPUs' memory together),
    simulated samples/s, bytes moved, and samples/s over :data:`BASELINE`'s."""
    hw = preset(hardware)
    policies = list(policies or names())
    # one search for the searched systems; the plain loop (resident) has a chooser
    # too, which says why where it fits no GPU
    searched = [p for p in policies if p in SEARCHABLE and p not in CHOOSERS]
    rows = []
    for model in models:
        spec = model_spec(model)
        for minibatch in minibatches:
            plans = dict(plans_for(searched, spec, hw, minibatch, workers)) if searched else {}
            for policy in policies:
                plan, reason = plans.get(policy), "the search's fastest plan"
                if policy not in searched:
                    try:
                        plan, reason = plan_for(policy, spec, hw, minibatch), "its own chooser"
                    except OutOfMemoryError as e:
                        reason = str(e)
                row = {"model": model, "minibatch": minibatch, "policy": policy, "reason": reason}
                if plan is None:
                    rows.append({**row, "fits": False})
                    continue
                s = simulate(spec, hw, plan).summary
                rows.append(
                    {
                        **row,
                        "role": POLICIES[policy].ROLE,
                        "plan": plan.describe(),
                        "n_gpus": plan.n_gpus,
                        "microbatch": plan.bwd_microbatch,
                        "fits": s.fits,
                        "samples_per_s": s.samples_per_s,
                        **_moved_gb(s),
                    }
                )
    df = pd.DataFrame(rows)
    base = df[df.policy == BASELINE].set_index(["model", "minibatch"]).samples_per_s
    df["vs_baseline"] = [
        r.samples_per_s / base.get((r.model, r.minibatch), math.nan) for r in df.itertuples()
    ]
    return df


#: the per-layer swapping baselines KARMA is held against: label -> choose_layer_swap options
#: (vDNN-style swapping of every layer's input, and checkpointing that recomputes instead)
OUT_OF_CORE = {BASELINE: {}, f"{BASELINE}, recompute": {"activations": "recompute"}}


def karma_table(
    models: Sequence[str], minibatches: Sequence[int], hardware: str = HARDWARE
) -> pd.DataFrame:
    """KARMA against the out-of-core methods it compares itself with (1.52x on
    average in its paper): per model and minibatch, KARMA's plan and each
    per-layer swapping baseline of :data:`OUT_OF_CORE`, each by its own chooser
    on all GPUs of ``hardware``, simulated. ``karma_speedup``: the baseline's
    time over KARMA's (and without the preset's fixed cost per task);
    ``microbatch``, ``fits``, ``reason``: the baseline's."""
    hw = preset(hardware)
    rows = []
    for model in models:
        spec = model_spec(model)
        for minibatch in minibatches:
            case = {"model": model, "minibatch": minibatch}
            try:
                karma = plan_for("karma", spec, hw, minibatch)
            except OutOfMemoryError as e:
                rows.append({**case, "baseline": "karma", "fits": False, "reason": str(e)})
                continue
            mine = _played(spec, hw, karma)
            for label, options in OUT_OF_CORE.items():
                try:
                    plan = choose_layer_swap(spec, hw, minibatch, **options)
                except OutOfMemoryError as e:
                    rows.append({**case, "baseline": label, "fits": False, "reason": str(e)})
                    continue
                theirs = _played(spec, hw, plan)
                rows.append(
                    {
                        **case,
                        "baseline": label,
                        "microbatch": plan.bwd_microbatch,
                        "fits": theirs["fits"],
                        "reason": "its own chooser: the largest microbatch that fits",
                        "plan": plan.describe(),
                        "iteration_s": theirs["iteration_s"],
                        "karma_plan": karma.describe(),
                        "karma_microbatch": karma.bwd_microbatch,
                        "karma_iteration_s": mine["iteration_s"],
                        "karma_speedup": theirs["iteration_s"] / mine["iteration_s"],
                        "karma_speedup_no_fixed": theirs["iteration_s_no_fixed"]
                        / mine["iteration_s_no_fixed"],
                    }
                )
    return pd.DataFrame(rows)


#: the systems HYDRA's model selection is held against, one model after another on all GPUs
HYDRA_BASELINES = ("model-parallel", "gpipe-swap")


def hydra_table(jobs: list[Job], hardware: str = HARDWARE) -> pd.DataFrame:
    """HYDRA's merged schedule against training the same jobs one after another
    with each of :data:`HYDRA_BASELINES` on all GPUs (its own chooser's plan per
    model; the total is each model's steps x its simulated iteration). A job a
    baseline cannot plan (model parallelism needs the whole model in the GPUs'
    memory) is left out of that comparison, and HYDRA runs on the same jobs:
    ``reason`` says which and why. ``hydra_speedup``: the baseline's total
    time over HYDRA's."""
    hw = preset(hardware)
    rows = []
    for baseline in HYDRA_BASELINES:
        kept, left_out, total = [], [], 0.0
        microbatches = set()
        for job in jobs:
            try:
                plan = plan_for(baseline, job.spec, hw, job.plan.minibatch)
            except OutOfMemoryError as e:
                left_out.append(f"{job.label}: {e}")
                continue
            kept.append(job)
            microbatches.add(plan.bwd_microbatch)
            total += job.steps * simulate(job.spec, hw, plan).summary.iteration_s
        row = {
            "baseline": baseline,
            "jobs": ", ".join(j.label for j in kept),
            "microbatch": ", ".join(map(str, sorted(microbatches))),
            "fits": bool(kept),
            "reason": "; ".join(left_out),
        }
        if kept:
            merged = simulate_many(kept, hw, "merged").total_s
            row.update(baseline_total_s=total, hydra_total_s=merged, hydra_speedup=total / merged)
        rows.append(row)
    return pd.DataFrame(rows)


def depth_grid_jobs(
    model: str, depths: Sequence[int], minibatch: int, steps: int, hardware: str = HARDWARE
) -> list[Job]:
    """A model-selection workload: ``model`` (a reference profile: an embedding,
    a run of identical blocks, then its head) cut to each depth in ``depths``,
    each a :class:`~harmony.planner.multi_model.Job` with its best 1-GPU Harmony plan and
    its best plan over all GPUs (used when models run one after another)."""
    full, hw = model_spec(model), preset(hardware)
    kind = full.layers[1].name.partition(":")[2]
    blocks = next(
        (i - 1 for i, c in enumerate(full.layers[1:], 1) if c.name.partition(":")[2] != kind),
        len(full) - 1,
    )
    jobs = []
    for depth in depths:
        if not 1 <= depth <= blocks:
            raise HarmonyError(
                f"{model} has {blocks} blocks; depths must be between 1 and {blocks}, got {depth}"
            )
        spec = replace(
            full,
            name=f"{model}-{depth}L",
            layers=full.layers[: 1 + depth] + full.layers[1 + blocks :],
        )
        one = (
            search(spec, hw, minibatch, policies=HARMONY_POLICIES[:1], n_gpus=1, workers=1)
            .iloc[0]
            .plan
        )
        wide = (
            search(spec, hw, minibatch, policies=HARMONY_POLICIES, n_gpus=hw.n_gpus, workers=1)
            .iloc[0]
            .plan
        )
        jobs.append(Job(spec, one, steps, spec.name, wide))
    return jobs


def schedules_table(jobs: list[Job], hardware: str = HARDWARE) -> pd.DataFrame:
    """Total time to train every job under each schedule of
    :func:`~harmony.planner.multi_model.compare_schedules`, plus one model at a time on one GPU."""
    hw = preset(hardware)
    df = compare_schedules(jobs, hw)
    alone = simulate_many([replace(j, parallel_plan=None) for j in jobs], hw, "sequential").row()
    alone["schedule"] = "sequential, 1 GPU"
    alone["over_merged"] = alone["total_s"] / df.set_index("schedule").total_s["merged"]
    return pd.concat([df, pd.DataFrame([alone])], ignore_index=True)
