"""Altair charts of traces and tables, and saving them as SVG + PNG.

Every chart takes its colours from :mod:`harmony.workbench.palette`: one colour
per task kind and per policy everywhere. How notebooks display them offline is
:mod:`harmony.workbench.display`'s job; importing this module imports it, which
switches altair to its renderer, and its API (:func:`use_renderer`,
:func:`mimebundle`, :class:`Displayable`) is importable from here too.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pandas as pd

from ..trace import Trace
from . import palette
from .display import (
    RENDERER_ENV,
    RENDERERS,
    Displayable,
    load_altair,
    mimebundle,
    use_renderer,
)

__all__ = [
    "LANES",
    "MAX_ROWS",
    "RENDERERS",
    "RENDERER_ENV",
    "Displayable",
    "bar_chart",
    "coalesce",
    "loss_chart",
    "memory_chart",
    "mimebundle",
    "plan_notation",
    "policy_bars",
    "problem_chart",
    "save",
    "thin_memory",
    "timeline_chart",
    "use_renderer",
]

#: Altair's default row limit; large traces are aggregated to stay under it
MAX_ROWS = 5000
#: what a timeline's lane names mean
LANES = "lanes: compute; h2d: host → GPU; d2h: GPU → host; p2p: GPU → GPU; cpu: optimizer steps"
#: added to :data:`LANES` under a timeline with a disk tier's lanes
DISK_LANES = "; host.disk_read: disk → host; host.disk_write: host → disk"


# ---- traces ---------------------------------------------------------------------------------
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
        new_run = (
            (df.kind != df.groupby("lane").kind.shift())
            | (df.start_s - prev_end > gap)
            | prev_end.isna()
        )
        df = (
            df.groupby(new_run.cumsum())
            .agg(
                lane=("lane", "first"),
                kind=("kind", "first"),
                start_s=("start_s", "min"),
                end_s=("end_s", "max"),
                bytes=("bytes", "sum"),
                tasks=("tasks", "sum"),
                microbatch=("microbatch", "first"),
                layers=("layers", "first"),
                what=("what", "first"),
            )
            .reset_index(drop=True)
        )
        gap *= 2
    if len(df) <= max_rows:
        return df
    bins = max(1, max_rows // df.lane.nunique())
    t0 = float(df.start_s.min())
    width = span / bins
    df = df.assign(
        bin=((df.start_s - t0) / width).astype(int).clip(upper=bins - 1),
        busy=df.end_s - df.start_s,
    )
    busiest = df.groupby(["lane", "bin", "kind"]).busy.sum().reset_index().sort_values("busy")
    kind = busiest.drop_duplicates(["lane", "bin"], keep="last").set_index(["lane", "bin"]).kind
    out = (
        df.groupby(["lane", "bin"])
        .agg(
            start_s=("start_s", "min"),
            end_s=("end_s", "max"),
            bytes=("bytes", "sum"),
            tasks=("tasks", "sum"),
        )
        .reset_index()
    )
    out["kind"] = [kind[(lane, b)] for lane, b in zip(out.lane, out.bin)]
    return out.assign(
        microbatch=-1, layers="", what=lambda d: d.tasks.astype(str) + " tasks"
    ).drop(columns="bin")


def _kind_legend(alt, title: str = "task kind"):
    """A legend that says what each kind is ("W_IN: weights host → GPU")."""
    words = json.dumps({k: f"{k}: {w}" for k, w in palette.KIND_WORDS.items()}, ensure_ascii=False)
    return alt.Legend(
        title=title,
        orient="bottom",
        columns=3,
        labelLimit=320,
        symbolType="square",
        labelExpr=f"({words})[datum.label] || datum.label",
    )


def timeline_chart(
    trace: Trace,
    title: str = "",
    width: int = 900,
    max_rows: int = MAX_ROWS,
    color: str = "kind",
    subtitle: str | list[str] = "",
    zoom: bool = True,
):
    """Gantt chart of one iteration: one row per lane, one bar per task (tasks
    that touch are merged when the trace has more than ``max_rows``), coloured
    by task ``kind`` (legend in words) or by another timeline column
    (``"model"`` for many models). With ``zoom``, drag or scroll to pan and
    zoom in time (charts sharing its time axis follow)."""
    alt = load_altair()
    timeline = trace.timeline
    if color != "kind":  # bars merge and take their colour by this column instead
        timeline = timeline.assign(kind=[f"{color} {v}" for v in timeline[color]])
    df = coalesce(timeline, max_rows)
    df = df.assign(
        duration_ms=(df.end_s - df.start_s) * 1e3,
        layers=df["layers"].astype(str),
        means=df.kind.map(palette.KIND_WORDS).fillna(""),
    )
    legend_color = _timeline_color(alt, df, color)
    lanes = sorted(df.lane.unique(), key=_lane_order)
    disk = DISK_LANES if any(lane.startswith("host.disk") for lane in lanes) else ""
    chart = (
        alt.Chart(
            df[
                [
                    "lane",
                    "kind",
                    "means",
                    "start_s",
                    "end_s",
                    "duration_ms",
                    "bytes",
                    "tasks",
                    "layers",
                    "microbatch",
                    "what",
                ]
            ]
        )
        .mark_bar(height={"band": 0.8})
        .encode(
            x=alt.X("start_s:Q", title="time in the iteration (s)", scale=alt.Scale(nice=False)),
            x2="end_s:Q",
            y=alt.Y("lane:N", sort=lanes, title="lane"),
            color=legend_color,
            tooltip=[
                alt.Tooltip("kind:N", title="kind"),
                alt.Tooltip("means:N", title="what it is"),
                "what",
                "tasks",
                "layers",
                "microbatch",
                alt.Tooltip("duration_ms:Q", format=".2f", title="duration (ms)"),
                alt.Tooltip("bytes:Q", format=".3s", title="bytes"),
            ],
        )
        .properties(
            title=alt.Title(title, subtitle=[*_lines(subtitle), LANES + disk]),
            width=width,
            height=max(120, 22 * len(lanes)),
        )
    )
    return (
        chart.add_params(alt.selection_interval(bind="scales", encodings=["x"])) if zoom else chart
    )


def _timeline_color(alt, df, color: str):
    """The bars' colour: by task kind (the palette, the legend in words), or by the
    column ``color`` (Tableau's ten colours)."""
    if color == "kind":
        return alt.Color(
            "kind:N", scale=alt.Scale(**palette.kind_scale(df.kind)), legend=_kind_legend(alt)
        )
    return alt.Color(
        "kind:N",
        scale=alt.Scale(scheme="tableau10"),
        title=color,
        legend=alt.Legend(orient="bottom", columns=4),
    )


def _lines(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) and text else list(text or [])


def plan_notation(plan) -> str:
    """What ``plan.describe()``'s short names mean, with the plan's own numbers."""
    f, b = len(plan.fwd_packs), len(plan.bwd_packs)
    return (
        f"uF={plan.fwd_microbatch} / uB={plan.bwd_microbatch}: forward / backward microbatch "
        f"size; packs F{f}/B{b}: {f} forward and {b} backward layer packs"
    )


def _lane_order(lane: str) -> tuple:
    device, _, kind = lane.partition(".")
    order = {"compute": 0, "h2d": 1, "d2h": 2, "p2p": 3, "": 4}
    return (device.startswith("cpu"), device, order.get(kind, 5))


def memory_chart(
    trace: Trace, title: str = "GPU memory in use (dashed: capacity)", width: int = 900
):
    """Device memory in use over the iteration, with the capacity as a rule."""
    alt = load_altair()
    df = trace.memory_timeline().assign(gb=lambda d: d["bytes"] / 1e9)
    cap = pd.DataFrame(
        [{"device": d, "gb": c / 1e9} for d, c in trace.summary.memory_capacity.items()]
    )
    line = (
        alt.Chart(df)
        .mark_line(interpolate="step-after")
        .encode(
            x=alt.X("time_s:Q", title="time in the iteration (s)", scale=alt.Scale(nice=False)),
            y=alt.Y("gb:Q", title="memory in use (GB)"),
            color=alt.Color("device:N", title="device"),
            tooltip=[
                "device",
                alt.Tooltip("time_s:Q", format=".3f", title="time (s)"),
                alt.Tooltip("gb:Q", format=".3f", title="in use (GB)"),
            ],
        )
    )
    rule = (
        alt.Chart(cap)
        .mark_rule(strokeDash=[4, 4])
        .encode(
            y="gb:Q",
            color="device:N",
            tooltip=["device", alt.Tooltip("gb:Q", format=".2f", title="capacity (GB)")],
        )
    )
    return (line + rule).properties(title=title, width=width, height=200)


def thin_memory(trace: Trace, max_rows: int = MAX_ROWS) -> Trace:
    """``trace`` with its memory steps cut to at most ``max_rows`` points, for
    :func:`memory_chart`: per time bin and device, the highest level reached in
    the bin (at the bin's start, so peaks stay visible) and the level it ends on."""
    if sum(len(steps) for steps in trace.memory.values()) <= max_rows:
        return trace
    times = [t for steps in trace.memory.values() for t, _ in steps]
    t0, bins = min(times), max(1, max_rows // (2 * len(trace.memory)))
    width = (max(times) - t0) / bins or 1.0
    thin = {}
    for device, steps in trace.memory.items():
        # bin -> (highest level in it, its last step)
        per_bin: dict[int, tuple[float, tuple[float, float]]] = {}
        for t, b in steps:
            k = min(int((t - t0) / width), bins - 1)
            per_bin[k] = (max(b, per_bin[k][0]) if k in per_bin else b, (t, b))
        thin[device] = []
        for k, (high, (t, b)) in sorted(per_bin.items()):
            thin[device].append((t0 + k * width, high))
            if b != high:
                thin[device].append((t, b))
    return Trace(trace.summary, thin)


def problem_chart(problem: str, width: int = 900):
    """The problem as red text, wrapped to the chart's width."""
    alt = load_altair()
    text = "\n".join(textwrap.wrap("Problem: " + problem, width // 7))
    return (
        alt.Chart(pd.DataFrame({"text": [text]}))
        .mark_text(align="left", baseline="top", lineBreak="\n", color="#c0392b", fontSize=13)
        .encode(text="text:N", x=alt.value(0), y=alt.value(0))
        .properties(
            width=width, height=18 * (text.count("\n") + 1), view=alt.ViewBackground(stroke=None)
        )
    )


# ---- tables ---------------------------------------------------------------------------------
def bar_chart(
    df: pd.DataFrame,
    x: str,
    y: str,
    color: str | None = None,
    title: str = "",
    log: bool = False,
    y_title: str | None = None,
):
    """Bars of ``y`` per ``x``, side by side per ``color`` (policies and other
    series in their palette colours) and never stacked (a log scale needs
    every bar to start at the axis). Long ``x`` labels are slanted."""
    alt = load_altair()
    groups = max(1, df[color].nunique()) if color else 1
    width = max(240, 70 * df[x].nunique() * groups // 2)
    longest = max((len(str(v)) for v in df[x]), default=0)
    slant = longest * 7 > width / max(1, df[x].nunique())  # ~7 px per character at 11 px
    axis = (
        alt.Axis(labelAngle=-30, labelAlign="right", labelLimit=220)
        if slant
        else alt.Axis(labelAngle=0)
    )
    scale = alt.Scale(type="log") if log else alt.Scale(zero=True)
    enc = {
        "x": alt.X(f"{x}:N", title=None, sort=None, axis=axis),
        "y": alt.Y(f"{y}:Q", title=y_title or y, scale=scale, stack=None),
        "tooltip": list(df.columns),
    }
    if color:
        enc["xOffset"] = alt.XOffset(f"{color}:N")
        enc["color"] = alt.Color(
            f"{color}:N",
            title=None,
            scale=alt.Scale(**palette.series_scale(df[color])),
            legend=alt.Legend(orient="bottom", columns=2, labelLimit=300),
        )
    return alt.Chart(df).mark_bar().encode(**enc).properties(title=title, width=width)


def policy_bars(
    df: pd.DataFrame,
    value: str,
    title: str,
    axis_title: str,
    chosen: str | None = None,
    fmt: str = ".3g",
    width: int = 360,
):
    """Horizontal bars of ``value`` per policy (columns ``policy``, ``value``,
    ``status``: "fits", "does not fit: ..." or "not run: ..."). Bars in the
    policy's colour, grey when the plan does not fit; each labelled with its
    number or its status; the ``chosen`` policy outlined and in bold."""
    alt = load_altair()
    d = df[["policy", value, "status"]].copy()
    d["fits"] = d.status == "fits"
    d["label"] = [
        f"{v:{fmt}}" if ok else (f"{v:{fmt}} (does not fit)" if pd.notna(v) else s)
        for v, s, ok in zip(d[value], d.status, d.fits)
    ]
    d["shade"] = [p if ok else "does not fit" for p, ok in zip(d.policy, d.fits)]
    d["chosen"] = d.policy == chosen
    d["at"] = d[value].fillna(0.0)  # where the label starts: the bar's end, or the axis
    colors = palette.series_scale(d.policy)
    scale = alt.Scale(
        domain=colors["domain"] + ["does not fit"], range=colors["range"] + [palette.NO_FIT]
    )
    top = float(d[value].max()) if d[value].notna().any() else 1.0
    y = alt.Y(
        "policy:N",
        sort=list(d.policy),
        title=None,
        axis=alt.Axis(
            labelFontWeight={
                "condition": {"test": f"datum.value == {json.dumps(chosen)}", "value": "bold"},
                "value": "normal",
            }
        ),
    )
    base = alt.Chart(d).encode(
        y=y, tooltip=["policy", alt.Tooltip(f"{value}:Q", format=fmt, title=axis_title), "status"]
    )
    bars = base.mark_bar().encode(
        # labels need room right of the longest bar
        x=alt.X(
            f"{value}:Q", title=axis_title, scale=alt.Scale(domain=[0, top * 1.6], nice=False)
        ),
        color=alt.Color("shade:N", scale=scale, legend=None),
        stroke=alt.condition("datum.chosen", alt.value("black"), alt.value(None)),
        strokeWidth=alt.condition("datum.chosen", alt.value(2), alt.value(0)),
    )
    text = base.mark_text(align="left", dx=4, limit=width * 0.6).encode(x="at:Q", text="label:N")
    return (bars + text).properties(title=title, width=width, height=24 * len(d))


def loss_chart(losses: pd.DataFrame, title: str = "", runs: dict[str, str] | None = None):
    """Loss per step of each run (``runs``: column -> label; default the
    engine over the plain loop): the first run a wide solid line, the others
    dashed on top of it, so equal curves show as a dashed line inside a solid one."""
    alt = load_altair()
    runs = runs or {"reference": "plain PyTorch loop", "engine": "harmony.Engine"}
    long = losses.melt(id_vars="step", value_vars=list(runs), var_name="run", value_name="loss")
    long["run"] = long["run"].map(runs)
    labels = list(runs.values())
    legend = alt.Legend(
        title=None,
        orient="top",
        symbolType="stroke",
        symbolStrokeWidth=3,
        symbolSize=500,
        labelLimit=300,
    )
    base = alt.Chart(long).encode(
        x=alt.X("step:O", title="training step", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("loss:Q", title="loss", scale=alt.Scale(zero=False)),
        color=alt.Color(
            "run:N",
            scale=alt.Scale(domain=labels, range=[palette.color(r) for r in labels]),
            legend=legend,
        ),
        strokeDash=alt.StrokeDash(
            "run:N",
            scale=alt.Scale(domain=labels, range=[[1, 0]] + [[6, 4]] * (len(labels) - 1)),
            legend=legend,
        ),
        tooltip=["run", "step", alt.Tooltip("loss:Q", format=".8f")],
    )
    first = alt.datum.run == labels[0]
    solid = base.transform_filter(first).mark_line(
        strokeWidth=6, opacity=0.45, point=alt.OverlayMarkDef(size=60)
    )
    dashed = base.transform_filter(~first).mark_line(
        strokeWidth=2, point=alt.OverlayMarkDef(size=20)
    )
    return (solid + dashed).properties(title=title, width=480, height=240)


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
