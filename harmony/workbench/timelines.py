"""Charts of one iteration in time: the swap timeline (a Gantt chart of every
lane's tasks) and GPU memory in use.

Servers with several GPUs have many lanes (four per GPU, one per CPU update
worker): the timeline groups them by GPU in shaded bands, draws every task at
least :data:`MIN_BAR_PX` wide so short transfers do not vanish, and lets the
reader pick lanes, from Python (``lanes=``) or from a menu under the chart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from ..errors import HarmonyError
from ..trace import Trace
from . import labels, palette
from .display import load_altair

#: Altair's default row limit; large traces are aggregated to stay under it
MAX_ROWS = 5000
#: what a timeline's lane names mean
LANES = "lanes: compute; h2d: host → GPU; d2h: GPU → host; p2p: GPU → GPU; cpu: optimizer steps"
#: added to :data:`LANES` under a timeline with a disk tier's lanes
DISK_LANES = "; host.disk_read: disk → host; host.disk_write: host → disk"
#: the narrowest a task is drawn at the chart's full width (its tooltip keeps its duration)
MIN_BAR_PX = 2.0
#: lanes from which the reader gets a menu to pick the lanes shown
MENU_FROM = 6
#: points per device of the memory chart: enough for the shape, few enough to read
MEMORY_BINS = 240
#: the lane kinds in the order they are drawn within a GPU's band
_LINKS = {"compute": 0, "h2d": 1, "d2h": 2, "p2p": 3}


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
    return _binned(df, max_rows, span)


def _binned(df: pd.DataFrame, max_rows: int, span: float) -> pd.DataFrame:
    """Each lane cut into equal time bins, each shown in the kind busiest in it."""
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


def lane_group(lane: str) -> str:
    """The band a lane is drawn in: its GPU (``gpu1.h2d`` -> ``gpu1``), ``cpu`` for
    the optimizer's workers, ``host`` for the disk's lanes."""
    device, dot, _ = lane.partition(".")
    if not dot and device.startswith("cpu"):
        return "cpu"
    return device


def lane_link(lane: str) -> str:
    """What a lane carries: ``compute``, ``h2d``, ``d2h``, ``p2p``, ``cpu``, ``disk_read`` ..."""
    device, dot, link = lane.partition(".")
    return link if dot else "cpu"


def _lane_order(lane: str) -> tuple:
    """GPUs first, in their number's order (gpu2 before gpu10), then the host and the CPU."""
    device, _, kind = lane.partition(".")
    numbered = re.fullmatch(r"(\D*)(\d+)", device)
    name, number = numbered.groups() if numbered else (device, "")
    link = _LINKS.get(kind, 4 if not kind else 5)
    return (device.startswith("cpu"), name, int(number or -1), link)


def pick_lanes(timeline: pd.DataFrame, lanes: Iterable[str] | None) -> pd.DataFrame:
    """The rows of ``timeline`` on ``lanes``: each a lane (``gpu0.h2d``), a GPU
    (``gpu1``: its lanes), a kind of lane (``h2d``: every GPU's) or ``cpu``."""
    if lanes is None:
        return timeline
    wanted = set(lanes)
    keep = [
        lane in wanted or lane_group(lane) in wanted or lane_link(lane) in wanted
        for lane in timeline.lane
    ]
    if not any(keep):
        known = sorted(set(timeline.lane), key=_lane_order)
        groups = sorted({lane_group(x) for x in known} | {lane_link(x) for x in known})
        raise HarmonyError(
            f"no lane of this timeline is in lanes={sorted(wanted)}; pick lanes from "
            f"{known}, GPUs or kinds of lane from {groups}"
        )
    return timeline[keep]


def timeline_bars(
    trace: Trace,
    width: int = 900,
    max_rows: int = MAX_ROWS,
    color: str = "kind",
    lanes: Iterable[str] | None = None,
    names: Sequence[str] | dict | None = None,
) -> tuple[pd.DataFrame, list[str], str]:
    """What :func:`timeline_chart` draws: its bars (:func:`coalesce`, then
    :func:`_bars`), the lanes in their order, and :data:`DISK_LANES` when the
    trace has the disk's lanes (else "")."""
    timeline = pick_lanes(trace.timeline, lanes)
    if color != "kind":  # bars merge and take their colour by this column instead
        timeline = timeline.assign(kind=[_named(color, v, names) for v in timeline[color]])
    df = _bars(coalesce(timeline, max_rows), width)
    order = sorted(df.lane.unique(), key=_lane_order)
    disk = DISK_LANES if any(lane.startswith("host.disk") for lane in order) else ""
    return df, order, disk


def timeline_chart(
    trace: Trace,
    title: str = "",
    width: int = 900,
    max_rows: int = MAX_ROWS,
    color: str = "kind",
    subtitle: str | list[str] = "",
    zoom: bool = True,
    lanes: Iterable[str] | None = None,
    names: Sequence[str] | dict | None = None,
):
    """Gantt chart of one iteration: one row per lane, grouped by GPU in shaded
    bands, one bar per task (tasks that touch are merged when the trace has more
    than ``max_rows``), each at least :data:`MIN_BAR_PX` wide, coloured by task
    ``kind`` (legend in words) or by another timeline column (``"model"`` for
    many models, its values named by ``names``: a list by value or a dict).
    ``lanes`` keeps some lanes (:func:`pick_lanes`); with many lanes a menu
    under the chart picks them too. With ``zoom``, drag or scroll to pan and
    zoom in time (charts sharing its time axis follow)."""
    alt = load_altair()
    df, order, disk = timeline_bars(trace, width, max_rows, color, lanes, names)

    y = alt.Y(
        "lane:N",
        sort=order,
        title="GPU and lane",
        axis=alt.Axis(labelLimit=160, labelOverlap=False),
    )
    bars = (
        alt.Chart(df)
        .mark_bar(height={"band": 0.8})
        .encode(
            x=alt.X("start_s:Q", title="time in the iteration (s)", scale=alt.Scale(nice=False)),
            x2="drawn_end_s:Q",
            y=y,
            color=_timeline_color(alt, df, color),
            tooltip=[
                alt.Tooltip(**t) for t in labels.text_tooltip(TIMELINE_TOOLTIPS, TIMELINE_DRAWN)
            ],
        )
    )
    bands = (  # every other GPU's lanes shaded, so one GPU's lanes read as a group
        alt.Chart(df)
        .transform_filter("datum.band == 1")
        .transform_aggregate(tasks="count()", groupby=["lane", "group", "link"])
        .mark_rect(color="#000000", opacity=0.05)
        .encode(y=y)
    )
    chart = alt.layer(bands, bars).properties(
        title=alt.Title(
            title or "one iteration, lane by lane", subtitle=[*_lines(subtitle), LANES + disk]
        ),
        width=width,
        height=alt.Step(16),
    )
    if len(order) >= MENU_FROM:
        chart = _with_lane_menu(alt, chart, order)
    return (
        chart.add_params(alt.selection_interval(bind="scales", encodings=["x"])) if zoom else chart
    )


def _named(column: str, value, names) -> str:
    """A colour category's label: its name from ``names``, else "<column> <value>"."""
    if isinstance(names, dict) and value in names:
        return str(names[value])
    if isinstance(names, Sequence) and isinstance(value, int) and 0 <= value < len(names):
        return str(names[value])
    return f"{column} {value}"


def _bars(df: pd.DataFrame, width: int) -> pd.DataFrame:
    """The bars' columns: the lane, its GPU (every other one shaded) and kind, the
    start and the drawn end (at least :data:`MIN_BAR_PX` wide), and what the tooltip
    shows, as text (:data:`TIMELINE_TOOLTIPS`: durations in ms, layers and
    descriptions in words)."""
    span = float(df.end_s.max() - df.start_s.min()) or 1.0
    shortest = span * MIN_BAR_PX / width
    groups = list(dict.fromkeys(lane_group(x) for x in sorted(set(df.lane), key=_lane_order)))
    bars = pd.DataFrame(
        {
            "lane": df.lane,
            "group": _each(df.lane, lane_group),
            "band": _each(df.lane, lambda x: groups.index(lane_group(x)) % 2),
            "link": _each(df.lane, lane_link),
            "kind": df.kind,
            "means": df.kind.map(palette.KIND_WORDS).fillna(""),
            "start_s": df.start_s,
            "drawn_end_s": df.end_s.where(
                df.end_s - df.start_s >= shortest, df.start_s + shortest
            ),
            "duration_ms": (df.end_s - df.start_s) * 1e3,
            "bytes": df["bytes"],
            "tasks": df["tasks"],
            "layers": _each(df["layers"], labels.layer_range),
            "microbatch": df["microbatch"],
            "what": _each(df["what"], lambda x: labels.spans(str(x))),
        }
    )
    return labels.tooltip_texts(bars, TIMELINE_TOOLTIPS, TIMELINE_DRAWN)


def _each(values, words) -> list:
    """``[words(v) for v in values]``, each distinct value put in words once (a
    timeline repeats its lanes, packs and task names thousands of times)."""
    done: dict = {}
    out = []
    for v in values.tolist():  # Python objects: iterating a Series boxes each cell
        try:
            out.append(done[v] if v in done else done.setdefault(v, words(v)))
        except TypeError:  # unhashable: put in words every time
            out.append(words(v))
    return out


def _with_lane_menu(alt, chart, order: list[str]):
    """``chart`` with a menu of the lanes to show: all, one GPU's, or one kind of lane."""
    groups = list(dict.fromkeys(lane_group(x) for x in order))
    links = [x for x in dict.fromkeys(lane_link(x) for x in order) if x not in groups]
    options = ["all", *groups, *links]
    pick = alt.param(
        value="all",
        bind=alt.binding_select(options=options, name="lanes shown (a GPU or a kind of lane): "),
    )
    shown = f"{pick.name} == 'all' || {pick.name} == datum.group || {pick.name} == datum.link"
    layers = [layer.transform_filter(shown) for layer in chart.layer]
    return (
        alt.layer(*layers, data=chart.data)
        .properties(title=chart.title, width=chart.width, height=chart.height)
        .add_params(pick)
    )


#: the timeline's tooltips: (column, title, d3 format or None); :func:`labels.tooltip_texts`
#: writes the numbers as text
TIMELINE_TOOLTIPS = (
    ("lane", "lane", None),
    ("kind", "task kind", None),
    ("means", "what it is", None),
    ("what", "task", None),
    ("tasks", "tasks in this bar", "d"),
    ("layers", "layers", None),
    ("microbatch", "microbatch (-1: all)", "d"),
    ("start_s", "start (s)", ".4~f"),
    ("duration_ms", "duration (ms)", ".3~g"),
    ("bytes", "bytes", ".3~s"),
)
#: the timeline's columns drawn as numbers: their tooltip text is another column
TIMELINE_DRAWN = ("start_s",)
#: the memory chart's tooltips, as :data:`TIMELINE_TOOLTIPS` but formatted by vega: its
#: numbers are drawn, so their text would double its data (a few hundred points)
MEMORY_TOOLTIPS = (
    ("device", "device", None),
    ("time_s", "time (s)", ".3~f"),
    ("high_gb", "highest in use (GB)", ".3~g"),
    ("low_gb", "lowest in use (GB)", ".3~g"),
    ("capacity_gb", "capacity (GB)", ".3~g"),
)
#: significant digits of the memory chart's numbers
DRAWN_DIGITS = 7


def kind_label_expr() -> str:
    """The kind legend's label expression: each kind in words ("W_IN: weights host → GPU")."""
    words = json.dumps({k: f"{k}: {w}" for k, w in palette.KIND_WORDS.items()}, ensure_ascii=False)
    return f"({words})[datum.label] || datum.label"


def _kind_legend(alt, title: str = "task kind"):
    """A legend that says what each kind is ("W_IN: weights host → GPU")."""
    return alt.Legend(
        title=title,
        orient="bottom",
        columns=3,
        labelLimit=320,
        symbolType="square",
        labelExpr=kind_label_expr(),
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
        title=labels.title(color),
        legend=alt.Legend(orient="bottom", columns=4, labelLimit=320),
    )


def _lines(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) and text else list(text or [])


def memory_chart(
    trace: Trace, title: str = "GPU memory in use (dashed: capacity)", width: int = 900
):
    """Memory in use over the iteration, one row per device: the band between the
    lowest and highest level in each of :data:`MEMORY_BINS` time bins (a step of
    every microbatch would draw a comb), its top as a line, the capacity dashed."""
    alt = load_altair()
    df = memory_bands(trace, MEMORY_BINS)
    devices = list(dict.fromkeys(df.device))
    base = alt.Chart().encode(
        x=alt.X("time_s:Q", title="time in the iteration (s)", scale=alt.Scale(nice=False))
    )
    y = alt.Y("high_gb:Q", title="in use (GB)", axis=alt.Axis(tickCount=3))
    band = base.mark_area(interpolate="step-after", opacity=0.35).encode(
        y=y, y2="low_gb:Q", color=_device_color(alt, devices)
    )
    top = base.mark_line(interpolate="step-after").encode(
        y=y,
        color=_device_color(alt, devices),
        tooltip=[alt.Tooltip(**t) for t in labels.formatted_tooltip(MEMORY_TOOLTIPS)],
    )
    # one rule per device (not one per time bin)
    cap = alt.Chart().mark_rule(strokeDash=[4, 4], color="#555555").encode(y="max(capacity_gb):Q")
    return (
        alt.layer(band, top, cap, data=df)
        .properties(width=width, height=60)
        .facet(
            row=alt.Row("device:N", title="device", sort=devices, header=alt.Header(labelAngle=0))
        )
        .properties(title=title)
        .resolve_scale(y="shared")
    )


def _device_color(alt, devices: list[str]):
    # no legend: each row is headed by its device, and a legend right of the rows made the
    # explorer's chart wider than its output (cut there)
    return alt.Color("device:N", title="device", sort=devices, legend=None)


def _bin_levels(times, levels, t0: float, width: float, bins: int):
    """The lowest and highest of ``levels`` (at ``times``, in time order) in each of
    ``bins`` bins of ``width`` from ``t0``, the level entering a bin included."""
    k = np.minimum(((times - t0) / width).astype(int), bins - 1)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])  # times in order: bins are runs
    lowest, highest, last = np.full((3, bins), np.nan)
    lowest[k[starts]] = np.minimum.reduceat(levels, starts)
    highest[k[starts]] = np.maximum.reduceat(levels, starts)
    last[k[starts]] = levels[np.r_[starts[1:], len(levels)] - 1]
    # the level entering each bin: the last one before it (the first level, before any)
    seen = np.maximum.accumulate(np.where(np.isnan(last), -1, np.arange(bins)))
    entering = np.r_[levels[0], np.where(seen >= 0, last[np.maximum(seen, 0)], levels[0])[:-1]]
    return np.fmin(lowest, entering), np.fmax(highest, entering)


def memory_bands(trace: Trace, bins: int) -> pd.DataFrame:
    """Per device and time bin: the lowest and highest level in the bin (the level
    entering it counts) in GB, and the device's capacity."""
    steps = trace.memory_timeline()
    if steps.empty:
        raise HarmonyError("this trace has no memory steps to draw")
    t0, t1 = float(steps.time_s.min()), float(steps.time_s.max())
    width = (t1 - t0) / bins or 1.0
    rows = []
    for device, d in steps.groupby("device", sort=False):
        d = d.sort_values("time_s")
        low, high = _bin_levels(d.time_s.to_numpy(), d["bytes"].to_numpy(float), t0, width, bins)
        capacity = trace.summary.memory_capacity.get(device, float("nan"))
        rows.append(
            pd.DataFrame(
                {
                    "device": device,
                    "time_s": _digits(t0 + np.arange(bins) * width),
                    "low_gb": _digits(low / 1e9),
                    "high_gb": _digits(high / 1e9),
                    "capacity_gb": _digits(np.full(bins, capacity / 1e9)),
                }
            )
        )
    return pd.concat(rows, ignore_index=True)


def _digits(values: np.ndarray) -> list[float]:
    """``values`` to :data:`DRAWN_DIGITS` significant digits: what a chart a few hundred
    pixels high can show, in half the bytes of a float's 17 digits."""
    return [float(f"{v:.{DRAWN_DIGITS}g}") for v in values.tolist()]


def thin_memory(trace: Trace, max_rows: int = MAX_ROWS) -> Trace:
    """``trace`` with its memory steps cut to at most ``max_rows`` points: per time
    bin and device, the highest level reached in the bin (at the bin's start, so
    peaks stay visible) and the level it ends on."""
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
