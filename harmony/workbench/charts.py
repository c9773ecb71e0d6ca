"""Altair charts of traces and search results, and saving them as SVG + PNG.

Altair and vl-convert come with the ``notebooks`` extra; they are imported
when a chart is made, so the library itself does not need them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..errors import HarmonyError
from ..trace import Trace

#: one colour per task kind, grouped: compute warm, host link cool, GPU-GPU green
KIND_COLORS = {
    "FWD": "#f58518", "BWD": "#e45756", "FWDBWD": "#b279a2", "UPD": "#9d755d",
    "W_IN": "#4c78a8", "G_OUT": "#72b7b2", "STASH_OUT": "#54a24b", "STASH_IN": "#88d27a",
    "ACT_OUT": "#bab0ac", "ACT_IN": "#d6d6d6", "DATA_IN": "#eeca3b", "P2P": "#2ca02c", "REDUCE": "#17becf",
}


#: Altair's default row limit; large traces are aggregated to stay under it
MAX_ROWS = 5000


def _altair():
    try:
        import altair as alt
    except ImportError:  # pragma: no cover - depends on the install
        raise HarmonyError("charts need altair: pip install -e '.[notebooks]'") from None
    return alt


def coalesce(timeline: pd.DataFrame, max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """At most ``max_rows`` bars for a timeline: first merge back-to-back tasks of
    one kind on one lane (allowing gaps up to 0.2% of the iteration); if that is
    not enough, cut each lane into equal time bins shown in the kind that kept
    the lane busiest in the bin. ``tasks`` counts the tasks behind each bar and
    ``bytes`` adds up."""
    df = timeline.sort_values(["lane", "start_s"]).assign(tasks=1)
    if len(df) <= max_rows:
        return df
    span = float(df.end_s.max() - df.start_s.min())
    gap = span * 1e-5
    while len(df) > max_rows and gap <= span * 2e-3:
        prev_end = df.groupby("lane").end_s.shift()
        new_run = (df.kind != df.groupby("lane").kind.shift()) | (df.start_s - prev_end > gap) | prev_end.isna()
        df = df.groupby(new_run.cumsum()).agg(
            lane=("lane", "first"), kind=("kind", "first"), start_s=("start_s", "min"), end_s=("end_s", "max"),
            bytes=("bytes", "sum"), tasks=("tasks", "sum"), microbatch=("microbatch", "first"),
            layers=("layers", "first"), what=("what", "first"),
        ).reset_index(drop=True)
        gap *= 2
    if len(df) <= max_rows:
        return df
    bins = max(1, max_rows // df.lane.nunique())
    t0 = float(df.start_s.min())
    width = span / bins
    df = df.assign(bin=((df.start_s - t0) / width).astype(int).clip(upper=bins - 1),
                   busy=df.end_s - df.start_s)
    busiest = df.groupby(["lane", "bin", "kind"]).busy.sum().reset_index().sort_values("busy")
    kind = busiest.drop_duplicates(["lane", "bin"], keep="last").set_index(["lane", "bin"]).kind
    out = df.groupby(["lane", "bin"]).agg(start_s=("start_s", "min"), end_s=("end_s", "max"),
                                          bytes=("bytes", "sum"), tasks=("tasks", "sum")).reset_index()
    out["kind"] = [kind[(lane, b)] for lane, b in zip(out.lane, out.bin)]
    return out.assign(microbatch=-1, layers="", what=lambda d: d.tasks.astype(str) + " tasks").drop(columns="bin")


def timeline_chart(trace: Trace, title: str = "", width: int = 900, max_rows: int = MAX_ROWS,
                   color: str = "kind"):
    """Gantt chart of one iteration: one row per lane, one bar per task (tasks
    that touch are merged when the trace has more than ``max_rows``), coloured
    by task ``kind`` or by another timeline column (``"model"`` for many models)."""
    alt = _altair()
    timeline = trace.timeline
    if color != "kind":  # bars merge and take their colour by this column instead
        timeline = timeline.assign(kind=[f"{color} {v}" for v in timeline[color]])
    df = coalesce(timeline, max_rows)
    df = df.assign(duration_ms=(df.end_s - df.start_s) * 1e3, layers=df["layers"].astype(str))
    kinds = [k for k in KIND_COLORS if k in set(df.kind)] if color == "kind" else sorted(set(df.kind))
    scale = alt.Scale(domain=kinds, range=[KIND_COLORS[k] for k in kinds]) if color == "kind" else \
        alt.Scale(domain=kinds, scheme="tableau10")
    lanes = sorted(df.lane.unique(), key=_lane_order)
    return (
        alt.Chart(df[["lane", "kind", "start_s", "end_s", "duration_ms", "bytes", "tasks", "layers", "microbatch",
                      "what"]])
        .mark_bar(height={"band": 0.8})
        .encode(
            x=alt.X("start_s:Q", title="time (s)"),
            x2="end_s:Q",
            y=alt.Y("lane:N", sort=lanes, title=None),
            color=alt.Color("kind:N", scale=scale, title=color),
            tooltip=["kind", "what", "tasks", "layers", "microbatch", alt.Tooltip("duration_ms:Q", format=".2f"),
                     alt.Tooltip("bytes:Q", format=".3s")],
        )
        .properties(title=title, width=width, height=max(120, 22 * len(lanes)))
    )


def _lane_order(lane: str) -> tuple:
    device, _, kind = lane.partition(".")
    order = {"compute": 0, "h2d": 1, "d2h": 2, "p2p": 3, "": 4}
    return (device.startswith("cpu"), device, order.get(kind, 5))


def memory_chart(trace: Trace, title: str = "", width: int = 900):
    """Device memory in use over the iteration, with the capacity as a rule."""
    alt = _altair()
    df = trace.memory_timeline().assign(gb=lambda d: d["bytes"] / 1e9)
    cap = pd.DataFrame([{"device": d, "gb": c / 1e9} for d, c in trace.summary.memory_capacity.items()])
    line = alt.Chart(df).mark_line(interpolate="step-after").encode(
        x=alt.X("time_s:Q", title="time (s)"), y=alt.Y("gb:Q", title="GB in use"), color="device:N")
    rule = alt.Chart(cap).mark_rule(strokeDash=[4, 4]).encode(y="gb:Q", color="device:N")
    return (line + rule).properties(title=title, width=width, height=200)


def bar_chart(df: pd.DataFrame, x: str, y: str, color: str | None = None, title: str = "", log: bool = False,
              y_title: str | None = None):
    """Bars of ``y`` per ``x``, side by side per ``color`` and never stacked (a log
    scale needs every bar to start at the axis)."""
    alt = _altair()
    scale = alt.Scale(type="log") if log else alt.Scale(zero=True)
    enc = {"x": alt.X(f"{x}:N", title=None, sort=None, axis=alt.Axis(labelAngle=0)),
           "y": alt.Y(f"{y}:Q", title=y_title or y, scale=scale, stack=None), "tooltip": list(df.columns)}
    groups = 1
    if color:
        enc["xOffset"] = alt.XOffset(f"{color}:N")
        enc["color"] = alt.Color(f"{color}:N", title=None, legend=alt.Legend(orient="bottom", columns=2))
        groups = max(1, df[color].nunique())
    return alt.Chart(df).mark_bar().encode(**enc).properties(
        title=title, width=max(240, 70 * df[x].nunique() * groups // 2))


def save(chart, path: str | Path, formats: tuple[str, ...] = ("svg", "png")) -> list[Path]:
    """Write ``chart`` as ``path`` with each suffix in ``formats`` (vl-convert renders)."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        target = base.with_suffix(f".{fmt}")
        kwargs = {"scale_factor": 2} if fmt == "png" else {}
        chart.save(str(target), **kwargs)
        out.append(target)
    return out
