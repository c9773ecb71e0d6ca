"""Harmony against the paper's baselines over the paper's grid of models and
minibatches (figures 10 and 11), simulated: each system's plan, what it costs,
and the ratios held against the paper's claims. :func:`best_plans` (the
search's fastest plan per policy) and :func:`_played` serve the other
simulated tables too."""

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
from ...errors import OutOfMemoryError
from ...plan import Plan
from ...planner import plan_for, search, simulate
from ..reproduce import source_hash
from .settings import ABLATION, BASELINES, HARDWARE, HARMONY_POLICIES, hardware_for


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
