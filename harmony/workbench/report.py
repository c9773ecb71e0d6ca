"""Readable text for search results and simulated iterations."""

from __future__ import annotations

import pandas as pd

from ..plan import Plan
from ..trace import Trace


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def format_search(df: pd.DataFrame, top: int = 10) -> str:
    a = df.attrs
    cols = [
        "rank",
        "policy",
        "n_gpus",
        "fwd_microbatch",
        "bwd_microbatch",
        "fwd_packs",
        "bwd_packs",
        "offload_activations",
        "iteration_s",
        "samples_per_s",
        "peak_memory_gb",
        "swap_gb",
        "p2p_gb",
        "limited_by",
    ]
    shown = (
        df[cols]
        .head(top)
        .rename(
            columns={
                "fwd_microbatch": "uF",
                "bwd_microbatch": "uB",
                "fwd_packs": "F",
                "bwd_packs": "B",
                "offload_activations": "offload",
                "iteration_s": "iter_s",
                "samples_per_s": "samples/s",
                "peak_memory_gb": "peak_GB",
                "swap_gb": "swap_GB",
                "p2p_gb": "gpu2gpu_GB",
            }
        )
    )
    best = df.groupby("policy", sort=False).head(1)[["policy", "iteration_s", "swap_gb"]]
    lines = [
        f"{a.get('model')} on {a.get('hardware')}, minibatch {a.get('minibatch')}: "
        f"{a.get('simulated')} plans simulated in {a.get('search_s', 0):.1f} s, "
        f"{a.get('rejected_memory')} rejected (over GPU memory), {len(df)} fit",
        shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"),
        "",
        "best per policy:",
        best.to_string(index=False, float_format=lambda v: f"{v:.3g}"),
    ]
    return "\n".join(lines)


def format_summary(plan: Plan, trace: Trace) -> str:
    s = trace.summary
    lines = [
        f"plan: {plan.describe()}",
        f"  forward packs  {list(plan.fwd_packs)}",
        f"  backward packs {list(plan.bwd_packs)}",
        f"iteration {s.iteration_s:.3f} s, {s.samples_per_s:.2f} samples/s, "
        f"lower bound {s.lower_bound_s:.3f} s ({s.lower_bound_by}), "
        f"time / bound {s.time_over_lower_bound:.2f}",
        "bytes moved: "
        + ", ".join(f"{k} {gb(v)}" for k, v in sorted(s.bytes_by_kind.items()) if v),
        "peak memory: "
        + ", ".join(
            f"{d} {gb(v)} / {gb(s.memory_capacity[d])}" for d, v in sorted(s.peak_memory.items())
        ),
        "fits: " + ("yes" if s.fits else "NO: over GPU memory"),
    ]
    return "\n".join(lines)
