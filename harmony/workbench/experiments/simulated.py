"""The simulated figures: every number here comes from playing a plan's task
graph in the simulator, with the GTX 1080 Ti per-layer profiles measured by
the Harmony authors (:func:`harmony.model_spec`) on the paper's servers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import pandas as pd

from ...costs.catalog import model_spec
from ...costs.hardware import preset
from ...costs.reference import max_profiled
from ...errors import HarmonyError, OutOfMemoryError
from ...plan import Plan
from ...planner import plans_for, search, simulate
from ...planner.multi_model import Job, compare_schedules, simulate_many
from ...trace import Summary
from .settings import BASELINE, HARDWARE, HARMONY_POLICIES, hardware_for


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
    policies: Sequence[str] = (*HARMONY_POLICIES, BASELINE),
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


def swap_volume_table(
    models: Sequence[str],
    minibatches: Sequence[int],
    hardware: str = HARDWARE,
    workers: int | None = None,
) -> pd.DataFrame:
    """Host<->GPU bytes per iteration of the fastest Harmony plan (pipeline or
    data parallel), the fastest pipeline plan, the Harmony plan that moves
    least, and the fastest virtualized-memory plan, each the search's pick."""
    rows = []
    for model in models:
        for mb in minibatches:
            best = best_plans(model, mb, hardware, workers=workers)
            h, pp, vm = (
                best.fastest(HARMONY_POLICIES),
                best.per_policy.get("harmony-pp"),
                best.per_policy.get(BASELINE),
            )
            harmony_rows = best.table[best.table["policy"].isin(HARMONY_POLICIES)]
            leanest = None if harmony_rows.empty else harmony_rows.sort_values("swap_gb").iloc[0]
            rows.append(
                {
                    "model": model,
                    "minibatch": mb,
                    "harmony_plan": _plan_text(h),
                    "harmony_swap_gb": _get(h, "swap_gb"),
                    "harmony_iteration_s": _get(h, "iteration_s"),
                    "harmony_pp_swap_gb": _get(pp, "swap_gb"),
                    "harmony_min_swap_gb": _get(leanest, "swap_gb"),
                    "baseline_plan": _plan_text(vm),
                    "baseline_swap_gb": _get(vm, "swap_gb"),
                    "baseline_iteration_s": _get(vm, "iteration_s"),
                    "search_s": best.search_s,
                }
            )
    df = pd.DataFrame(rows)
    df["swap_ratio"] = df["baseline_swap_gb"] / df["harmony_swap_gb"]
    df["swap_ratio_pp"] = df["baseline_swap_gb"] / df["harmony_pp_swap_gb"]
    df["swap_ratio_min"] = df["baseline_swap_gb"] / df["harmony_min_swap_gb"]
    return df


def throughput_table(
    models: Sequence[str],
    minibatches: Sequence[int],
    hardware: str = HARDWARE,
    workers: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulated samples/s of the fastest plan of each policy. Returns (long: one
    row per model, minibatch and policy; wide: one row per model and minibatch
    with the speedups of Harmony over virtual memory)."""
    long_rows, wide_rows = [], []
    policies = (*HARMONY_POLICIES, BASELINE)
    for model in models:
        for mb in minibatches:
            best = best_plans(model, mb, hardware, workers=workers)
            wide = {"model": model, "minibatch": mb, "search_s": best.search_s}
            for p in policies:
                r = best.per_policy.get(p)
                long_rows.append(
                    {
                        "model": model,
                        "minibatch": mb,
                        "policy": p,
                        "plan": _plan_text(r),
                        "samples_per_s": _get(r, "samples_per_s"),
                        "iteration_s": _get(r, "iteration_s"),
                        "swap_gb": _get(r, "swap_gb"),
                        "limited_by": None if r is None else r["limited_by"],
                    }
                )
                wide[f"{p}_samples_per_s"] = _get(r, "samples_per_s")
            vm = wide[f"{BASELINE}_samples_per_s"]
            for p in HARMONY_POLICIES:
                wide[f"speedup_{p}"] = wide[f"{p}_samples_per_s"] / vm
            wide["speedup"] = max(wide[f"{p}_samples_per_s"] for p in HARMONY_POLICIES) / vm
            wide_rows.append(wide)
    return pd.DataFrame(long_rows), pd.DataFrame(wide_rows)


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
    """Simulated samples/s and bytes moved per iteration of every system's best
    plan, per model and minibatch, with samples/s over the harmony-no-grouping baseline's."""
    hw = preset(hardware)
    rows = []
    for model in models:
        spec = model_spec(model)
        for minibatch in minibatches:
            for policy, plan in plans_for(policies, spec, hw, minibatch, workers).items():
                s = simulate(spec, hw, plan).summary
                rows.append(
                    {
                        "model": model,
                        "minibatch": minibatch,
                        "policy": policy,
                        "plan": plan.describe(),
                        "n_gpus": plan.n_gpus,
                        "samples_per_s": s.samples_per_s,
                        **_moved_gb(s),
                    }
                )
    df = pd.DataFrame(rows)
    base = df[df.policy == BASELINE].set_index(["model", "minibatch"]).samples_per_s
    df["vs_virtual_memory"] = [
        r.samples_per_s / base.get((r.model, r.minibatch), math.nan) for r in df.itertuples()
    ]
    return df


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
