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

from . import labels, palette
from .display import (
    RENDERER_ENV,
    RENDERERS,
    Displayable,
    load_altair,
    mimebundle,
    use_renderer,
)
from .timelines import (
    DISK_LANES,
    LANES,
    MAX_ROWS,
    coalesce,
    memory_chart,
    thin_memory,
    timeline_chart,
)

__all__ = [
    "DISK_LANES",
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


def plan_notation(plan) -> str:
    """What ``plan.describe()``'s short names mean, with the plan's own numbers."""
    f, b = len(plan.fwd_packs), len(plan.bwd_packs)
    return (
        f"uF={plan.fwd_microbatch} / uB={plan.bwd_microbatch}: forward / backward microbatch "
        f"size; packs F{f}/B{b}: {f} forward and {b} backward layer packs"
    )


def problem_text(problem: str, width: int = 900) -> str:
    """The problem's words in lines about ``width`` px wide."""
    return "\n".join(textwrap.wrap("Problem: " + problem, width // 7))


def problem_chart(problem: str, width: int = 900):
    """The problem as red text, wrapped to the chart's width."""
    alt = load_altair()
    text = problem_text(problem, width)
    return (
        alt.Chart(pd.DataFrame({"text": [text]}))
        .mark_text(align="left", baseline="top", lineBreak="\n", color="#c0392b", fontSize=13)
        .encode(text="text:N", x=alt.value(0), y=alt.value(0))
        .properties(
            width=width, height=18 * (text.count("\n") + 1), view=alt.ViewBackground(stroke=None)
        )
    )


# ---- tables ---------------------------------------------------------------------------------
#: px per bar of a bar chart without series
BAR_STEP = 64


def bar_chart(
    df: pd.DataFrame,
    x: str,
    y: str,
    color: str | None = None,
    title: str = "",
    log: bool = False,
    y_title: str | None = None,
    x_title: str | None = None,
    color_title: str | None = None,
    scale: dict | None = None,
):
    """Bars of ``y`` per ``x``, never stacked (a log scale needs every bar to start
    at the axis). With ``color``, one panel per ``x`` value holding only the
    series it has (no empty slots), each bar in its series' palette colour.
    (``scale``: ``{"domain", "range"}`` of the series' colours instead). Titles default
    to :func:`labels.title` of the columns; long labels are slanted."""
    alt = load_altair()
    y_scale = alt.Scale(type="log") if log else alt.Scale(zero=True)
    y_enc = alt.Y(f"{y}:Q", title=y_title or labels.title(y), scale=y_scale, stack=None)
    tips = labels.tooltips(df)
    x_title = x_title or labels.title(x)
    if not color:
        x_enc = alt.X(f"{x}:N", title=x_title, sort=None, axis=_category_axis(alt, df[x]))
        return (
            alt.Chart(df)
            .mark_bar()
            .encode(x=x_enc, y=y_enc, tooltip=tips)
            .properties(
                title=fitted_title(title, BAR_STEP * df[x].nunique()), width=alt.Step(BAR_STEP)
            )
        )
    scale = scale or palette.series_scale(df[color])
    series = list(scale["domain"])
    color_title = color_title or labels.title(color)
    per_panel = int(df.groupby(x, sort=False)[color].nunique().max()) if len(df) else 1
    step = max(18, 96 // max(1, per_panel))
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=alt.X(
                f"{color}:N",
                sort=series,
                title=color_title,
                axis=alt.Axis(labels=False, ticks=False),
            ),
            y=y_enc,
            color=alt.Color(
                f"{color}:N",
                title=color_title,
                scale=alt.Scale(**scale),
                legend=alt.Legend(orient="bottom", columns=2, labelLimit=300),
            ),
            tooltip=tips,
        )
        .properties(width=alt.Step(step))
    )
    header = alt.Header(labelAngle=0, labelExpr="split(datum.label, ', ')", labelLimit=200)
    return (
        alt.layer(bars, data=df)
        .facet(
            column=alt.Column(
                f"{x}:N", title=x_title, sort=list(dict.fromkeys(df[x])), header=header
            )
        )
        .resolve_scale(x="independent")
        .properties(title=fitted_title(title, df[x].nunique() * (per_panel * step + 20)))
    )


#: pixels per character of a chart's title (bold, 13 px), a little generous
TITLE_CHAR_PX = 8


def fitted_title(title: str, width_px: int) -> str | list[str]:
    """``title`` as one line, or as lines no wider than ``width_px`` (vega centres a
    title over its chart and cuts what does not fit at both edges)."""
    per_line = max(24, width_px // TITLE_CHAR_PX)
    return title if len(title) <= per_line else textwrap.wrap(title, per_line)


def _longest(values) -> int:
    return max((len(str(v)) for v in values), default=0)


def _category_axis(alt, values):
    """An axis for category labels: slanted when the longest would not fit its slot
    (about 6.5 px per character at altair's 10 px labels)."""
    if _longest(values) * 6.5 > BAR_STEP:
        return alt.Axis(labelAngle=-30, labelAlign="right", labelLimit=220)
    return alt.Axis(labelAngle=0)


def policy_bar_frame(
    df: pd.DataFrame, value: str, chosen: str | None, fmt: str = ".3g"
) -> tuple[pd.DataFrame, dict, float]:
    """What :func:`policy_bars` draws: one row per policy (``value``, its status,
    its label, its shade, whether it is ``chosen``, where its label starts), the
    shades' colours (``{"domain", "range"}``) and the largest value."""
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
    shades = {
        "domain": colors["domain"] + ["does not fit"],
        "range": colors["range"] + [palette.NO_FIT],
    }
    top = float(d[value].max()) if d[value].notna().any() else 1.0
    return d, shades, top


def bold_label(chosen: str | None) -> dict:
    """An axis's label weight: bold for the ``chosen`` category."""
    return {
        "condition": {"test": f"datum.value == {json.dumps(chosen)}", "value": "bold"},
        "value": "normal",
    }


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
    d, colors, top = policy_bar_frame(df, value, chosen, fmt)
    scale = alt.Scale(**colors)
    y = alt.Y(
        "policy:N",
        sort=list(d.policy),
        title="policy",
        axis=alt.Axis(labelFontWeight=bold_label(chosen)),
    )
    base = alt.Chart(d).encode(
        y=y,
        tooltip=[
            alt.Tooltip("policy:N", title="policy"),
            alt.Tooltip(f"{value}:Q", format=fmt, title=axis_title),
            alt.Tooltip("status:N", title="status"),
        ],
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
    shown = list(runs.values())
    legend = alt.Legend(
        title="run",
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
            scale=alt.Scale(domain=shown, range=[palette.color(r) for r in shown]),
            legend=legend,
        ),
        strokeDash=alt.StrokeDash(
            "run:N",
            scale=alt.Scale(domain=shown, range=[[1, 0]] + [[6, 4]] * (len(shown) - 1)),
            legend=legend,
        ),
        tooltip=[
            alt.Tooltip("run:N", title="run"),
            alt.Tooltip("step:O", title="training step"),
            alt.Tooltip("loss:Q", format=".8f", title="loss"),
        ],
    )
    first = alt.datum.run == shown[0]
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
