"""Lesson 3: just-in-time scheduling and the CPU update."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from ...costs.hardware import Hardware
from ...costs.spec import ModelSpec
from ...graph import (
    BWD,
    FWDBWD,
    G_OUT,
    REC,
    STASH_IN,
    UPD,
    W_IN,
)
from ...plan import Plan
from ...planner import simulate
from ...trace import Trace
from .. import labels
from .common import (
    COMPUTE_KINDS,
    LEGEND,
    PIPELINE,
    _gb,
    with_link,
)


# ---- lesson 3: just-in-time scheduling and the CPU update ---------------------------------
def gpu_idle_s(trace: Trace) -> float:
    """Seconds of the iteration the busiest GPU's compute lane does nothing."""
    tl = trace.timeline
    compute = tl[tl["kind"].isin(COMPUTE_KINDS)]
    busy = (compute["end_s"] - compute["start_s"]).groupby(compute["device"]).sum()
    return float(trace.summary.iteration_s - busy.max())


def idle_gaps(trace: Trace, device: str = "gpu0", top: int = 5) -> pd.DataFrame:
    """The ``top`` longest waits of ``device``'s compute lane, longest first, with
    the tasks before and after each (the iteration's start and end count too)."""
    tl = trace.timeline
    c = tl[(tl["device"] == device) & tl["kind"].isin(COMPUTE_KINDS)].sort_values("start_s")
    ends = [0.0, *c["end_s"]]
    starts = [*c["start_s"], trace.summary.iteration_s]
    before = ["(start of the iteration)", *c["what"]]
    after = [*c["what"], "(end of the iteration)"]
    rows = [
        {"idle_ms": (s - e) * 1e3, "from_s": e, "after": b, "before": a}
        for e, s, b, a in zip(ends, starts, before, after)
        if s > e
    ]
    longest = pd.DataFrame(rows).sort_values("idle_ms", ascending=False)
    return longest.head(top).reset_index(drop=True)


def update_overlap(trace: Trace) -> dict[str, float]:
    """How the CPU updates (UPD) sit against the GPU work: their total time,
    the part done while a GPU still computes (overlapped with backward), and
    the tail, from the last GPU task to the end of the iteration."""
    tl = trace.timeline
    upd = tl[tl["kind"] == UPD]
    gpu_end = float(tl[tl["kind"].isin(COMPUTE_KINDS)]["end_s"].max())
    total = float((upd["end_s"] - upd["start_s"]).sum())
    before = float((upd["end_s"].clip(upper=gpu_end) - upd["start_s"].clip(upper=gpu_end)).sum())
    return {
        "update_s": total,
        "overlapped_s": before,
        "overlapped_share": before / total if total else math.nan,
        "last_gpu_task_s": gpu_end,
        "tail_s": float(trace.summary.iteration_s - gpu_end),
        "iteration_s": float(trace.summary.iteration_s),
    }


def scheduling_sweep(
    spec: ModelSpec,
    hw: Hardware,
    minibatch: int,
    microbatch: int,
    layers_per_pack: int,
    prefetch_depths: Sequence[int],
    links: Sequence[str],
) -> pd.DataFrame:
    """Harmony-PP on one GPU for every (host link rate, prefetch depth): the
    iteration time, the GPU's idle time, the update tail and the peak memory."""
    rows = []
    for link in links:
        server = with_link(hw, link)
        for depth in prefetch_depths:
            plan = Plan.uniform(
                PIPELINE,
                1,
                minibatch,
                microbatch,
                len(spec),
                layers_per_pack,
                prefetch_packs=depth,
            )
            trace = simulate(spec, server, plan)
            s = trace.summary
            rows.append(
                {
                    "link": link,
                    "link_GBps": server.h2d / 1e9,
                    "prefetch_packs": depth,
                    "iteration_s": s.iteration_s,
                    "gpu_idle_s": gpu_idle_s(trace),
                    "update_tail_s": update_overlap(trace)["tail_s"],
                    "peak_gb": _gb(max(s.peak_memory.values())),
                    "fits": s.fits,
                    "limited_by": s.lower_bound_by,
                }
            )
    return pd.DataFrame(rows)


def scheduling_chart(df: pd.DataFrame, title: str = ""):
    """Iteration time and GPU idle time against the prefetch depth, one line per link rate."""
    import altair as alt

    x = alt.X(
        "prefetch_packs:O",
        title="prefetch_packs (weights resident at once)",
        axis=alt.Axis(labelAngle=0),
    )
    color = alt.Color("link:N", sort=None, title="host link", legend=LEGEND)
    base = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=x,
            color=color,
            tooltip=labels.tooltips(
                df,
                ["link", "prefetch_packs", "iteration_s", "gpu_idle_s", "peak_gb", "limited_by"],
            ),
        )
    )
    return alt.hconcat(
        base.encode(
            y=alt.Y("iteration_s:Q", title="iteration (s)", scale=alt.Scale(zero=False))
        ).properties(width=260, height=220, title="iteration time"),
        base.encode(y=alt.Y("gpu_idle_s:Q", title="GPU idle (s)")).properties(
            width=260, height=220, title="GPU compute lane idle"
        ),
    ).properties(title=title)


def pack_story(trace: Trace, plan: Plan, pack: int) -> pd.DataFrame:
    """Every task of backward pack ``pack`` (an index into ``plan.bwd_packs``) of a
    grouped plan, in the order it started: weights in, stashed inputs in,
    recompute, backward, gradients out, the CPU update; times in milliseconds."""
    layers = plan.bwd_packs[pack]
    tl = trace.timeline
    same = tl["layers"].map(lambda r: tuple(r) == layers)
    own = same & tl["kind"].isin((REC, BWD, FWDBWD, G_OUT, UPD))
    loads = tl.index[same & (tl["kind"] == W_IN)]
    own |= tl.index == loads[-1]  # a forward pack on the same layers loaded them first
    stash = (tl["kind"] == STASH_IN) & tl["what"].str.startswith(f"stash layer {layers[0]} ")
    df = tl[own | stash].sort_values("start_s")
    return df.assign(start_ms=df["start_s"] * 1e3, end_ms=df["end_s"] * 1e3, MB=df["bytes"] / 1e6)[
        ["lane", "kind", "microbatch", "start_ms", "end_ms", "MB", "what"]
    ].reset_index(drop=True)
