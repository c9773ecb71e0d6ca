"""The pack explorer's chart as a Vega-Lite dict, built directly.

Altair takes seconds to build and serialize the explorer's chart (every
composition deep-copies its parts, every encoding is validated), most of the
time of a redraw. The live view needs only the spec: :func:`exploration_spec`
writes the same spec that ``PackExplorer.chart(result).to_dict()`` gives (the
same marks, encodings, scales, titles and data rows; only the generated names
of views, parameters and datasets differ, a test checks it), in a tenth of
altair's time or less (``bench/explorer_chart.py``).
The altair chart stays what :meth:`PackExplorer.chart` returns, to save or
compose. Each part's data comes from the functions the altair charts use
(:func:`~.timelines.timeline_bars`, :func:`~.timelines.memory_bands`,
:func:`~.charts.policy_bar_frame`).
"""

from __future__ import annotations

import functools
import math
import textwrap

import pandas as pd

from ..planner.systems import PLAN_MAKERS
from . import palette
from .charts import bold_label, plan_notation, policy_bar_frame, problem_text
from .display import load_altair
from .labels import formatted_tooltip, text_tooltip
from .timelines import (
    LANES,
    MEMORY_BINS,
    MEMORY_TOOLTIPS,
    MENU_FROM,
    TIMELINE_DRAWN,
    TIMELINE_TOOLTIPS,
    kind_label_expr,
    lane_group,
    lane_link,
    memory_bands,
    thin_memory,
    timeline_bars,
)

_TYPES = {"N": "nominal", "Q": "quantitative"}
#: the parameters' names: the lane menu and the timeline's zoom, and the view zoomed
MENU, ZOOM, ZOOMED = "lanes_shown", "zoom", "timeline_view"


def field(name: str, kind: str, **more) -> dict:
    """An encoding of column ``name`` of type ``kind`` ("N" or "Q")."""
    return {"field": name, "type": _TYPES[kind], **more}


def tips(fields) -> list[dict]:
    """Tooltips of ``fields`` ((field, type, title, format or None) each)."""
    return [
        field(f, t, title=title, **({"format": fmt} if fmt else {})) for f, t, title, fmt in fields
    ]


def records(df: pd.DataFrame) -> list[dict]:
    """``df``'s rows as altair writes them (``to_values``): Python numbers, strings
    and booleans, NaN and infinities as None; a column at a time, not a cell."""
    columns = []
    for name in df.columns:
        values, kind = df[name].tolist(), df[name].dtype.kind
        if kind == "f" or (
            kind == "O" and pd.api.types.infer_dtype(values, skipna=False) != "string"
        ):
            values = [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
        columns.append(values)
    names = [str(c) for c in df.columns]
    return [dict(zip(names, row)) for row in zip(*columns)]


class Datasets:
    """The spec's data, by name: each part refers to its rows by name, as altair
    writes them."""

    def __init__(self):
        self.values: dict[str, list[dict]] = {}

    def add(self, df: pd.DataFrame) -> dict:
        name = f"data-{len(self.values)}"
        self.values[name] = records(df)
        return {"name": name}


@functools.cache
def _top() -> dict:
    """What altair adds at the top of every spec: its theme's config and the schema."""
    alt = load_altair()
    spec = alt.LayerChart().to_dict(validate=False)
    return {k: v for k, v in spec.items() if k in ("config", "$schema")}


def timeline_part(trace, data: Datasets, title: str, subtitle: str) -> tuple[dict, list[dict]]:
    """:func:`~.timelines.timeline_chart` of ``trace`` (900 px wide, zoom on) as a
    part of a concatenation, and the parameters it lifts to the top."""
    df, order, disk = timeline_bars(trace)
    y = field("lane", "N", sort=order, title="GPU and lane")
    y["axis"] = {"labelLimit": 160, "labelOverlap": False}
    color = field("kind", "N", scale=palette.kind_scale(df.kind))
    color["legend"] = {
        "columns": 3,
        "labelExpr": kind_label_expr(),
        "labelLimit": 320,
        "orient": "bottom",
        "symbolType": "square",
        "title": "task kind",
    }
    bands = {
        "mark": {"type": "rect", "color": "#000000", "opacity": 0.05},
        "encoding": {"y": y},
        "name": ZOOMED,
        "transform": [
            {"filter": "datum.band == 1"},
            {"aggregate": [{"op": "count", "as": "tasks"}], "groupby": ["lane", "group", "link"]},
        ],
    }
    time_axis = field("start_s", "Q", scale={"nice": False}, title="time in the iteration (s)")
    bars = {
        "mark": {"type": "bar", "height": {"band": 0.8}},
        "encoding": {
            "color": color,
            "tooltip": text_tooltip(TIMELINE_TOOLTIPS, TIMELINE_DRAWN),
            "x": time_axis,
            "x2": {"field": "drawn_end_s"},
            "y": y,
        },
    }
    params = []
    if len(order) >= MENU_FROM:
        params.append(_lane_menu(order))
        shown = f"{MENU} == 'all' || {MENU} == datum.group || {MENU} == datum.link"
        for layer in (bands, bars):
            layer["transform"] = [*layer.get("transform", []), {"filter": shown}]
    zoom = {"name": ZOOM, "select": {"type": "interval", "encodings": ["x"]}, "bind": "scales"}
    params.append({**zoom, "views": [ZOOMED]})
    part = {
        "layer": [bands, bars],
        "data": data.add(df),
        "height": {"step": 16},
        "title": {"text": title, "subtitle": [subtitle, LANES + disk]},
        "width": 900,
    }
    return part, params


def _lane_menu(order: list[str]) -> dict:
    """The lane menu's parameter: all, one GPU's lanes, or one kind of lane."""
    groups = list(dict.fromkeys(lane_group(x) for x in order))
    links = [x for x in dict.fromkeys(lane_link(x) for x in order) if x not in groups]
    return {
        "name": MENU,
        "bind": {
            "input": "select",
            "options": ["all", *groups, *links],
            "name": "lanes shown (a GPU or a kind of lane): ",
        },
        "value": "all",
    }


def memory_part(trace, data: Datasets) -> dict:
    """:func:`~.timelines.memory_chart` of ``trace`` thinned (:func:`thin_memory`)."""
    df = memory_bands(thin_memory(trace), MEMORY_BINS)
    devices = list(dict.fromkeys(df.device))
    x = field("time_s", "Q", scale={"nice": False}, title="time in the iteration (s)")
    y = field("high_gb", "Q", axis={"tickCount": 3}, title="in use (GB)")
    color = field("device", "N", legend=None, sort=devices, title="device")  # rows say it
    step = {"interpolate": "step-after"}
    band = {
        "mark": {"type": "area", **step, "opacity": 0.35},
        "encoding": {"color": color, "x": x, "y": y, "y2": {"field": "low_gb"}},
    }
    top = {
        "mark": {"type": "line", **step},
        "encoding": {
            "color": color,
            "tooltip": formatted_tooltip(MEMORY_TOOLTIPS),
            "x": x,
            "y": y,
        },
    }
    cap = {
        "mark": {"type": "rule", "color": "#555555", "strokeDash": [4, 4]},
        "encoding": {"y": field("capacity_gb", "Q", aggregate="max")},
    }
    row = field("device", "N", header={"labelAngle": 0}, sort=devices, title="device")
    return {
        "data": data.add(df),
        "facet": {"row": row},
        "spec": {"layer": [band, top, cap], "height": 60, "width": 900},
        "resolve": {"scale": {"y": "shared"}},
        "title": "GPU memory in use (dashed: capacity)",
    }


def bars_part(
    comparison: pd.DataFrame, value: str, title, axis_title: str, chosen, data: Datasets
) -> dict:
    """:func:`~.charts.policy_bars` (360 px wide, numbers as ``.3g``)."""
    fmt, width = ".3g", 360
    d, shades, top = policy_bar_frame(comparison, value, chosen, fmt)
    y = field("policy", "N", axis={"labelFontWeight": bold_label(chosen)})
    y.update(sort=list(d.policy), title="policy")
    tooltip = tips((("policy", "N", "policy", None), (value, "Q", axis_title, fmt)))
    tooltip.append(field("status", "N", title="status"))
    x = field(value, "Q", scale={"domain": [0, top * 1.6], "nice": False}, title=axis_title)
    bars = {
        "mark": {"type": "bar"},
        "encoding": {
            "color": field("shade", "N", legend=None, scale=shades),
            "stroke": {"condition": {"test": "datum.chosen", "value": "black"}, "value": None},
            "strokeWidth": {"condition": {"test": "datum.chosen", "value": 2}, "value": 0},
            "tooltip": tooltip,
            "x": x,
            "y": y,
        },
    }
    text = {
        "mark": {"type": "text", "align": "left", "dx": 4, "limit": width * 0.6},
        "encoding": {
            "text": field("label", "N"),
            "tooltip": tooltip,
            "x": field("at", "Q"),
            "y": y,
        },
    }
    return {
        "layer": [bars, text],
        "data": data.add(d),
        "height": 24 * len(d),
        "title": title,
        "width": width,
    }


def problem_part(problem: str, data: Datasets, width: int = 900) -> dict:
    """:func:`~.charts.problem_chart` of ``problem``."""
    text = problem_text(problem, width)
    return {
        "data": data.add(pd.DataFrame({"text": [text]})),
        "mark": {
            "type": "text",
            "align": "left",
            "baseline": "top",
            "color": "#c0392b",
            "fontSize": 13,
            "lineBreak": "\n",
        },
        "encoding": {"text": field("text", "N"), "x": {"value": 0}, "y": {"value": 0}},
        "height": 18 * (text.count("\n") + 1),
        "view": {"stroke": None},
        "width": width,
    }


def chart_texts(r) -> dict:
    """The titles of the explorer's chart of the :class:`~.exploration.Exploration`
    ``r``: the timeline's and its notation (with a trace), the bars' (``swap``
    with a subtitle when some plan has state on disk) and the whole chart's
    (``title``: the headlines, wrapped, and what the ratios are against)."""
    texts = {
        "time": "time per iteration (shorter is faster)",
        "swap": "bytes over host↔GPU links per iteration",
    }
    if r.trace is not None:
        texts["timeline"] = f"{r.plan.describe()}: {r.trace.iteration_s:.3g} s per iteration"
        texts["notation"] = plan_notation(r.plan)
    if (r.comparison["disk_gb"] > 0).any():  # counted apart, in the table
        texts["swap"] = {"text": texts["swap"], "subtitle": "not the disk's: disk GB in the table"}
    own = ", ".join(PLAN_MAKERS)
    subtitle = (
        f"ratios against {r.baseline}; {own} on their own plans, the others on these controls"
    )
    # vega does not wrap titles: lines about as wide as the charts
    lines = [part for line in r.headlines for part in textwrap.wrap(line, 110)]
    texts["title"] = {"text": lines, "subtitle": subtitle}
    return texts


def exploration_spec(r) -> dict:
    """The explorer's chart of the :class:`~.exploration.Exploration` ``r`` as a
    Vega-Lite dict: the spec of ``PackExplorer.chart(r)``."""
    texts, data = chart_texts(r), Datasets()
    parts, params = [problem_part(r.problem, data)] if r.problem else [], []
    if r.trace is not None:
        timeline, params = timeline_part(r.trace, data, texts["timeline"], texts["notation"])
        parts.append(
            {
                "vconcat": [timeline, memory_part(r.trace, data)],
                "resolve": {"scale": {"color": "independent", "x": "shared"}},
            }
        )
    if r.comparison["iteration_s"].notna().any():  # no empty bars
        chosen, time, swap = r.chosen or None, texts["time"], texts["swap"]
        parts.append(
            {
                "hconcat": [
                    bars_part(
                        r.comparison, "iteration_s", time, "seconds per iteration", chosen, data
                    ),
                    bars_part(r.comparison, "swap_gb", swap, "GB per iteration", chosen, data),
                ]
            }
        )
    spec = {
        **_top(),
        "vconcat": parts,
        "resolve": {"scale": {"color": "independent"}},
        "title": {**texts["title"], "anchor": "start", "fontSize": 16},
        "datasets": data.values,
    }
    if params:
        spec["params"] = params
    return spec
