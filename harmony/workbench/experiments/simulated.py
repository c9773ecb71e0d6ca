"""The simulated figures: every number here comes from playing a plan's task
graph in the simulator, with the GTX 1080 Ti per-layer profiles measured by
the Harmony authors (:func:`harmony.model_spec`) on the paper's servers."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from ...costs.catalog import model_spec
from ...costs.hardware import Hardware, preset
from ...costs.reference import max_profiled
from ...errors import HarmonyError, OutOfMemoryError
from ...plan import Plan
from ...planner import plan_for, plans_for, search, simulate
from ...planner.multi_model import Job, compare_schedules, simulate_many
from ...planner.search import SEARCHABLE
from ...planner.systems import choose_layer_swap
from ...policies import POLICIES, names
from ...trace import Summary
from ..reproduce import source_hash
from .settings import ABLATION, BASELINE, BASELINES, HARDWARE, HARMONY_POLICIES, hardware_for


@dataclass
class Best:
    """The fastest plan of each policy for one model and minibatch, from one search."""

    model: str
    minibatch: int
    per_policy: dict[str, pd.Series]
    search_s: float
    simulated: int
    table: pd.DataFrame = field(repr=False)

    def fastest(self, policies: Iterable[str]) -> pd.Series | None:
        rows = [self.per_policy[p] for p in policies if p in self.per_policy]
        return min(rows, key=lambda r: r["iteration_s"]) if rows else None


def best_plans(
    model: str,
    minibatch: int,
    hardware: str = HARDWARE,
    policies: Sequence[str] = (*HARMONY_POLICIES, ABLATION),
    n_gpus: int | None = None,
    workers: int | None = None,
) -> Best:
    """Search ``model`` at ``minibatch`` and keep the fastest plan of each policy
    (a policy with no plan that fits is absent)."""
    spec = model_spec(model)
    hw = hardware_for(n_gpus or preset(hardware).n_gpus, hardware)
    t0 = time.perf_counter()
    try:
        df = search(spec, hw, minibatch, policies=policies, n_gpus=n_gpus, workers=workers)
    except OutOfMemoryError:
        df = pd.DataFrame(columns=["policy", "iteration_s", "plan"])
        df.attrs.update(simulated=0)
    per_policy = {p: rows.iloc[0] for p, rows in df.groupby("policy", sort=False)}
    return Best(
        model,
        minibatch,
        per_policy,
        time.perf_counter() - t0,
        int(df.attrs.get("simulated", 0)),
        df,
    )


def _plan_text(row: pd.Series | None) -> str | None:
    return None if row is None else row["plan"].describe()


def _get(row: pd.Series | None, key: str) -> float:
    return math.nan if row is None else float(row[key])


def _played(spec, hw: Hardware, plan: Plan) -> dict:
    """What one iteration of ``plan`` costs on ``hw`` and on ``hw`` without its
    fixed cost per task (``iteration_s_no_fixed``): the paper's preset charges
    the Harmony authors' 40 ms per pack task, which a per-layer system pays
    once per layer and microbatch, so both are shown."""
    s = simulate(spec, hw, plan).summary
    return {
        "fits": s.fits,
        "iteration_s": s.iteration_s,
        "samples_per_s": s.samples_per_s,
        "swap_gb": s.swap_bytes / 1e9,
        "peak_gb": max(s.peak_memory.values()) / 1e9,
        "limited_by": s.lower_bound_by,
        "iteration_s_no_fixed": simulate(
            spec, replace(hw, task_overhead_s=0.0), plan
        ).summary.iteration_s,
    }


def _system_row(spec, hw: Hardware, system: str, role: str, plan: Plan | None, reason: str):
    """One system's plan and what it costs, or why it has none (``fits`` False)."""
    row = {"system": system, "role": role, "reason": reason}
    if plan is None:
        return {**row, "policy": None, "plan": None, "microbatch": None, "fits": False}
    return {
        **row,
        "policy": plan.policy,
        "plan": plan.describe(),
        "microbatch": plan.bwd_microbatch,
        **_played(spec, hw, plan),
    }


def paper_grid(
    models: Sequence[str],
    minibatches: Sequence[int],
    hardware: str = HARDWARE,
    workers: int | None = None,
    cache_dir: str | Path | None = None,
) -> pd.DataFrame:
    """Harmony against the paper's baselines on every model and minibatch, one
    row per system: Harmony's fastest plan (``harmony``, pipeline or data
    parallel) and least-swap plan that fits (``harmony (least swap)``), the
    fastest of each placement, the faithful baselines of :data:`BASELINES`
    (each by its own chooser: the largest microbatch that fits its own memory)
    and the :data:`ABLATION`, from the same search as Harmony's plans. Columns:
    the plan, its ``microbatch`` (backward), ``fits`` and ``reason`` (how the
    plan was chosen, or why there is none), simulated time, samples/s, host<->GPU
    GB, peak GPU memory, and the time without the preset's fixed cost per task.
    With ``cache_dir`` the table is kept there, under a key of the arguments and
    the ``harmony`` source, and read back when asked again: figures 10 and 11
    compute the same grid, so the second reads the first's."""
    if cache_dir is None:
        return _paper_grid(models, minibatches, hardware, workers)
    key = json.dumps([list(models), list(minibatches), hardware, source_hash()])
    path = Path(cache_dir) / f"paper_grid-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
    if path.exists():
        return pd.read_pickle(path)
    df = _paper_grid(models, minibatches, hardware, workers)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    df.to_pickle(part)
    os.replace(part, path)  # whole or absent: a run that dies leaves no half table
    return df


def _searched(row: pd.Series | None, what: str) -> tuple[Plan | None, str]:
    """A search's pick (a row of its table, or None) as (plan, reason)."""
    if row is None:
        return None, "no plan of the search fits in GPU memory"
    return row["plan"], what


def _paper_grid(
    models: Sequence[str], minibatches: Sequence[int], hardware: str, workers: int | None
) -> pd.DataFrame:
    hw = preset(hardware)
    rows = []
    for model in models:
        spec = model_spec(model)
        for mb in minibatches:
            best = best_plans(model, mb, hardware, workers=workers)
            found = best.table[best.table["policy"].isin(HARMONY_POLICIES)]
            picks = {  # (system, role) -> (its plan or None, how it was chosen or why none)
                ("harmony", "harmony"): _searched(
                    best.fastest(HARMONY_POLICIES), "the search's fastest Harmony plan"
                ),
                ("harmony (least swap)", "harmony"): _searched(
                    None if found.empty else found.sort_values("swap_gb").iloc[0],
                    "the Harmony plan that fits with the fewest host<->GPU bytes",
                ),
                **{
                    (p, "harmony"): _searched(best.per_policy.get(p), f"the search's fastest {p}")
                    for p in HARMONY_POLICIES
                },
                (ABLATION, "ablation"): _searched(
                    best.per_policy.get(ABLATION), f"the search's fastest {ABLATION}"
                ),
            }
            for baseline in BASELINES:
                try:
                    picks[baseline, "baseline"] = (
                        plan_for(baseline, spec, hw, mb),
                        "its own chooser: the largest microbatch that fits",
                    )
                except OutOfMemoryError as e:
                    picks[baseline, "baseline"] = None, str(e)
            for (system, role), (plan, reason) in picks.items():
                row = _system_row(spec, hw, system, role, plan, reason)
                rows.append({"model": model, "minibatch": mb, **row})
    return pd.DataFrame(rows)


def versus_baselines(grid: pd.DataFrame) -> pd.DataFrame:
    """From :func:`paper_grid`: one row per model, minibatch and system Harmony
    is held against (the faithful baselines, ``role`` "baseline", and the
    ablation), with that system's ``microbatch``, ``fits`` and ``reason``, and
    Harmony's swap reduction against its fastest plan (``swap_ratio``) and its
    least-swap plan (``swap_ratio_min``), and its speedup (``speedup``: the
    fastest Harmony plan; ``speedup_harmony-pp`` / ``-dp``: each placement's
    fastest; ``speedup_no_fixed``: without the preset's fixed cost per task)."""
    rows = []
    for (model, mb), case in grid.groupby(["model", "minibatch"], sort=False):
        by = case.set_index("system")
        h, lean = by.loc["harmony"], by.loc["harmony (least swap)"]
        for system, other in by[by["role"] != "harmony"].iterrows():
            row = {
                "model": model,
                "minibatch": mb,
                "baseline": system,
                "role": other["role"],
                "microbatch": other["microbatch"],
                "fits": other["fits"],
                "reason": other["reason"],
                "baseline_plan": other["plan"],
                "baseline_swap_gb": other["swap_gb"],
                "baseline_samples_per_s": other["samples_per_s"],
                "harmony_plan": h["plan"],
                "harmony_microbatch": h["microbatch"],
                "harmony_swap_gb": h["swap_gb"],
                "harmony_min_swap_plan": lean["plan"],
                "harmony_min_swap_gb": lean["swap_gb"],
                "harmony_samples_per_s": h["samples_per_s"],
                "swap_ratio": other["swap_gb"] / h["swap_gb"],
                "swap_ratio_min": other["swap_gb"] / lean["swap_gb"],
                "speedup": h["samples_per_s"] / other["samples_per_s"],
                "speedup_no_fixed": other["iteration_s_no_fixed"] / h["iteration_s_no_fixed"],
            }
            for p in HARMONY_POLICIES:
                row[f"speedup_{p}"] = by.loc[p, "samples_per_s"] / other["samples_per_s"]
            if not other["fits"]:  # no plan: nothing to hold Harmony against
                for k in row:
                    if k.startswith(("swap_ratio", "speedup")):
                        row[k] = math.nan
            rows.append(row)
    return pd.DataFrame(rows)


def grid_claims(versus: pd.DataFrame) -> dict[str, float]:
    """The numbers the figures hold against the paper's: over the cases and the
    faithful baselines (``role`` "baseline"), the largest and the geometric mean
    of each ratio of :func:`versus_baselines`; the same over the ablation with
    the prefix ``ablation_``."""
    out = {}
    for prefix, rows in (
        ("", versus[versus.role == "baseline"]),
        ("ablation_", versus[versus.role == "ablation"]),
    ):
        for col in ("swap_ratio", "swap_ratio_min", "speedup", "speedup_no_fixed"):
            values = rows[col].dropna()
            out[f"{prefix}max_{col}"] = float(values.max()) if len(values) else math.nan
            out[f"{prefix}geomean_{col}"] = (
                float(math.exp(values.map(math.log).mean())) if len(values) else math.nan
            )
    return out


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
    searched = [p for p in policies if p in SEARCHABLE]
    rows = []
    for model in models:
        spec = model_spec(model)
        for minibatch in minibatches:
            plans = dict(plans_for(searched, spec, hw, minibatch, workers)) if searched else {}
            for policy in policies:
                plan, reason = plans.get(policy), "the search's fastest plan"
                if policy not in SEARCHABLE:
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
