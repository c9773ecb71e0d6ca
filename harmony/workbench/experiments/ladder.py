"""The ablation ladder: from per-layer swapping to Harmony, one technique at a time.

Each rung is a plan of an existing policy with existing plan options; only
the named technique changes from one rung to the next:

0. ``layer-swap`` as a virtualized GPU memory runs it at its weakest: one layer
   at a time, the next layer loaded only when the current one is done
   (``prefetch_packs`` 1, on demand), gradient sums and the optimizer on the
   GPU (``gpu_gradients``, ``gpu_optimizer``), data parallel, at the largest
   microbatch that fits (its own chooser's rule);
1. packs: the same, on the packs *and microbatch* of Harmony's plan (the top
   rung's), so each pack's weights cross once per microbatch and pass: the
   planner picks packs and microbatch together, and a smaller microbatch
   costs per-microbatch swapping more trips, so this rung can be slower;
2. prefetch: the next pack's weights load while the current one computes
   (``prefetch_packs`` 2, double buffering);
3. CPU update overlapped with backward: gradients go to the host, which sums
   them, and each pack's optimizer step runs on the CPU as soon as its
   gradients are in (``gpu_gradients`` and ``gpu_optimizer`` off). This rung
   is ``harmony-no-grouping`` without the recompute overlap (the same graph);
4. input-batch grouping: ``harmony-dp``, each pack over all of a GPU's
   microbatches while its weights are resident (``overlap_recompute`` off);
5. p2p between GPUs: ``harmony-pp``, packs round-robin over the GPUs and
   activations passed GPU to GPU, not through host memory (data parallelism
   already all-reduces over the peer links; this rung is the pipeline);
6. recompute overlap: a backward pack recomputes its forward before its
   output gradient arrives (``overlap_recompute``, Harmony's published
   schedule). This is the top: Harmony-PP's fastest plan with equal forward
   and backward microbatches (per-microbatch swapping runs one size).

Every rung is simulated on the same server; a rung that does not fit in GPU
memory says so (``fits``) and has no time.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import pandas as pd

from ...costs.catalog import model_spec
from ...costs.hardware import preset
from ...errors import OutOfMemoryError
from ...plan import Plan
from ...planner import search, simulate
from ...planner.systems import choose_layer_swap
from .settings import BASELINE, HARDWARE

#: (technique the rung adds, how the plan expresses it), bottom to top
RUNGS = (
    (
        "per-layer swapping, on demand, optimizer on the GPU",
        "layer-swap, one layer per pack, prefetch_packs=1, gpu_gradients, gpu_optimizer",
    ),
    ("+ packs (Harmony's packs and microbatch)", "layer-swap on the top rung's packs"),
    ("+ prefetch", "prefetch_packs=2"),
    ("+ CPU update overlapped with backward", "gpu_gradients and gpu_optimizer off"),
    ("+ input-batch grouping", "harmony-dp, overlap_recompute off"),
    ("+ p2p between GPUs (pipeline)", "harmony-pp, overlap_recompute off"),
    ("+ recompute overlap", "harmony-pp (Harmony's schedule)"),
)


def ladder_plans(
    spec, hw, minibatch: int, workers: int | None = None
) -> list[tuple[str, str, Plan]]:
    """The plans of the rungs of :data:`RUNGS` for ``spec`` on all GPUs of ``hw``:
    (technique, how, plan), bottom to top. Raises OutOfMemoryError when the
    bottom rung or Harmony-PP has no plan that fits."""
    bottom = choose_layer_swap(spec, hw, minibatch, prefetch=False)
    top = search(
        spec, hw, minibatch, policies=["harmony-pp"], workers=workers, equal_microbatches=True
    ).iloc[0]["plan"]

    def on_top(policy: str, **options) -> Plan:
        return replace(top, policy=policy).with_options(**options)

    on_gpu = {"gpu_gradients": True, "gpu_optimizer": True}
    plans = [
        bottom,
        on_top(BASELINE, prefetch_packs=1, **on_gpu),
        on_top(BASELINE, prefetch_packs=2, **on_gpu),
        on_top(BASELINE, prefetch_packs=2),
        on_top("harmony-dp", overlap_recompute=False),
        on_top("harmony-pp", overlap_recompute=False),
        top,
    ]
    return [(what, how, plan) for (what, how), plan in zip(RUNGS, plans)]


def ablation_ladder(
    models: Sequence[str],
    minibatch: int,
    hardware: str = HARDWARE,
    workers: int | None = None,
) -> pd.DataFrame:
    """Every rung of :data:`RUNGS` per model at ``minibatch`` on ``hardware``:
    its plan, ``microbatch``, ``fits`` (and ``reason`` where not), simulated
    seconds per iteration (and without the preset's fixed cost per task), the
    speedup over the rung below and over the bottom rung, and the PCIe bytes
    per iteration: host<->GPU, GPU<->GPU (peer copies and reductions) and both."""
    hw = preset(hardware)
    rows = []
    for model in models:
        spec = model_spec(model)
        try:
            rungs = ladder_plans(spec, hw, minibatch, workers)
        except OutOfMemoryError as e:
            rows.append({"model": model, "minibatch": minibatch, "fits": False, "reason": str(e)})
            continue
        for rung, (what, how, plan) in enumerate(rungs):
            s = simulate(spec, hw, plan).summary
            kinds = s.bytes_by_kind
            gpu_gpu = kinds.get("P2P", 0.0) + kinds.get("REDUCE", 0.0)
            peak = max(s.peak_memory.values())
            rows.append(
                {
                    "model": model,
                    "minibatch": minibatch,
                    "rung": rung,
                    "technique": what,
                    "how": how,
                    "policy": plan.policy,
                    "plan": plan.describe(),
                    "microbatch": plan.bwd_microbatch,
                    "fits": s.fits,
                    "reason": "" if s.fits else f"peak {peak / 1e9:.2f} GB over GPU memory",
                    "iteration_s": s.iteration_s if s.fits else math.nan,
                    "iteration_s_no_fixed": (
                        simulate(spec, replace(hw, task_overhead_s=0.0), plan).summary.iteration_s
                        if s.fits
                        else math.nan
                    ),
                    "host_gpu_gb": s.swap_bytes / 1e9,
                    "gpu_gpu_gb": gpu_gpu / 1e9,
                    "pcie_gb": (s.swap_bytes + gpu_gpu) / 1e9,
                    "peak_gb": peak / 1e9,
                }
            )
    df = pd.DataFrame(rows)
    if "rung" in df:
        by_model = df.groupby("model", sort=False)["iteration_s"]
        df["speedup_vs_previous"] = by_model.shift(1) / df["iteration_s"]
        df["speedup_vs_bottom"] = by_model.transform("first") / df["iteration_s"]
        df["speedup_no_fixed_vs_bottom"] = (
            df.groupby("model", sort=False)["iteration_s_no_fixed"].transform("first")
            / df["iteration_s_no_fixed"]
        )
    return df


def ladder_claims(df: pd.DataFrame) -> dict:
    """Per model, Harmony-PP's speedup over the bottom rung (top / bottom; and
    without the preset's fixed cost per pack task) and the rung that gains
    most; over the models, the largest and the geometric mean of each speedup."""
    per_model = {}
    laddered = df[df["rung"].notna()] if "rung" in df else df.iloc[:0]
    for model, rows in laddered.groupby("model", sort=False):
        top = rows.iloc[-1]
        step = rows["speedup_vs_previous"]
        best = rows.loc[step.idxmax()] if step.notna().any() else None
        per_model[model] = {
            "total_speedup": float(top["speedup_vs_bottom"]),
            "total_speedup_no_fixed": float(top["speedup_no_fixed_vs_bottom"]),
            "largest_step": None if best is None else best["technique"],
            "largest_step_speedup": math.nan if best is None else float(best[step.name]),
        }
    out: dict = {"per_model": per_model}
    for key in ("total_speedup", "total_speedup_no_fixed"):
        totals = [v[key] for v in per_model.values() if math.isfinite(v[key])]
        out[f"max_{key}"] = max(totals) if totals else math.nan
        out[f"geomean_{key}"] = (
            math.exp(sum(map(math.log, totals)) / len(totals)) if totals else math.nan
        )
    return out
