"""Lesson 2: input-batch grouping."""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

import pandas as pd

from ...costs.hardware import Hardware
from ...costs.spec import ModelSpec
from ...graph import (
    G_OUT,
    STASH_IN,
    STASH_OUT,
    W_IN,
)
from ...planner import simulate
from ...trace import Trace
from .. import labels
from ..experiments import ABLATION
from .common import (
    COMPUTE_KINDS,
    LEGEND,
    PIPELINE,
    _gb,
    lesson_plan,
    policy_label,
    policy_scale,
)


# ---- lesson 2: input-batch grouping ------------------------------------------------------
def grouping_sweep(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch_counts: Sequence[int],
    layers_per_pack: int,
    policies: Sequence[str] = (PIPELINE, ABLATION),
) -> pd.DataFrame:
    """One GPU, fixed packs and minibatch; for every count M of microbatches
    that divides the minibatch (microbatch size = minibatch / M), each policy's
    bytes by kind and simulated iteration time (NaN where the plan does not fit
    in GPU memory: ``fits`` is False)."""
    rows = []
    for m in microbatch_counts:
        if m < 1 or minibatch % m:
            continue
        for policy in policies:
            plan = lesson_plan(policy, spec, hw, 1, minibatch, minibatch // m, layers_per_pack)
            s = simulate(spec, hw, plan).summary
            kinds = s.bytes_by_kind
            rows.append(
                {
                    "policy": policy_label(policy),
                    "microbatches": m,
                    "microbatch": minibatch // m,
                    "w_in_gb": _gb(kinds.get(W_IN, 0.0)),
                    "g_out_gb": _gb(kinds.get(G_OUT, 0.0)),
                    "stash_gb": _gb(kinds.get(STASH_OUT, 0.0) + kinds.get(STASH_IN, 0.0)),
                    "swap_gb": _gb(s.swap_bytes),
                    "fits": s.fits,
                    "iteration_s": s.iteration_s if s.fits else math.nan,
                    "peak_gb": _gb(max(s.peak_memory.values())),
                }
            )
    return pd.DataFrame(rows)


def grouping_chart(df: pd.DataFrame, title: str = ""):
    """Left: host<->GPU GB per iteration against the number of microbatches;
    right: simulated iteration time (plans that do not fit are left out)."""
    import altair as alt

    x = alt.X(
        "microbatches:Q",
        scale=alt.Scale(type="log", base=2),
        axis=alt.Axis(values=sorted(df["microbatches"].unique().tolist())),
        title="microbatches per minibatch (M)",
    )
    color = alt.Color("policy:N", title="policy", legend=LEGEND, scale=policy_scale(df["policy"]))
    tooltip = labels.tooltips(
        df, ["policy", "microbatches", "microbatch", "w_in_gb", "swap_gb", "iteration_s", "fits"]
    )
    base = alt.Chart(df).mark_line(point=True).encode(x=x, color=color, tooltip=tooltip)
    swap = base.encode(
        y=alt.Y(
            "swap_gb:Q", scale=alt.Scale(type="log"), title="host<->GPU GB per iteration (log)"
        )
    )
    step = base.transform_filter("datum.fits").encode(
        y=alt.Y("iteration_s:Q", title="iteration time (s, simulated)")
    )
    return alt.hconcat(
        swap.properties(width=300, height=220, title="bytes"),
        step.properties(width=300, height=220, title="time"),
    ).properties(title=title)


def task_counts(traces: Mapping[str, Trace]) -> pd.DataFrame:
    """Tasks of each kind per trace: how many weight loads (W_IN), gradient
    transfers (G_OUT) and compute tasks one iteration has."""
    rows = []
    for label, trace in traces.items():
        counts = trace.timeline["kind"].value_counts()
        kinds = (W_IN, G_OUT, *COMPUTE_KINDS)
        rows.append({"plan": label, **{k: int(counts.get(k, 0)) for k in kinds}})
    return pd.DataFrame(rows)


def timelines(traces: Mapping[str, Trace], width: int = 760):
    """The swap timelines of several traces, one above the other, titled by their labels."""
    import altair as alt

    from ..charts import timeline_chart

    charts = [
        timeline_chart(t, title=f"{label}: {t.summary.iteration_s:.3g} s", width=width)
        for label, t in traces.items()
    ]
    with warnings.catch_warnings():
        # each timeline brings the same zoom selection; altair merges them into one (so the
        # timelines zoom together) and says so
        warnings.filterwarnings("ignore", message=".*deduplicated selection parameter")
        # each its own legend: a shared colour scale would take one timeline's colours for
        # the kinds of both
        return alt.vconcat(*charts).resolve_scale(color="independent")
