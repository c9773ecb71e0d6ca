"""Altair charts of traces and tables, how notebooks display them, and saving them as SVG + PNG.

Every chart takes its colours from :mod:`harmony.workbench.palette`: one colour
per task kind and per policy everywhere.

**Display without internet.** Altair's own HTML output loads vega from a CDN,
and JupyterLab's built-in vega renderer does not draw altair 6's charts.
Importing this module therefore switches altair to one of these renderers
(:func:`use_renderer`; the ``HARMONY_CHARTS`` environment variable picks one):

* ``interactive`` (default): HTML that draws the chart with vega-embed, its
  JavaScript inlined from vl-convert (nothing is fetched), with tooltips and,
  on swap timelines, zoom and pan. The same HTML holds an SVG picture of the
  chart, shown until the script runs: a notebook opened untrusted (JupyterLab
  then runs no scripts), or a viewer without JavaScript, still shows the chart.
* ``static``: only the SVG picture, no JavaScript (smaller notebooks).
* ``altair``: altair's renderer as it was before (e.g. online, or with a
  JupyterLab extension that draws vega-lite 6).

Altair and vl-convert come with the ``notebooks`` extra; without them this
module still imports, and charts raise a message saying what to install.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import importlib.util
import json
import os
import uuid
import warnings
from pathlib import Path

import pandas as pd

from ..errors import HarmonyError
from ..trace import Trace
from . import palette

#: Altair's default row limit; large traces are aggregated to stay under it
MAX_ROWS = 5000
#: environment variable read by :func:`use_renderer` when no mode is given
RENDERER_ENV = "HARMONY_CHARTS"
RENDERERS = ("interactive", "static", "altair")
#: what a timeline's lane names mean
LANES = "lanes: compute; h2d: host → GPU; d2h: GPU → host; p2p: GPU → GPU; cpu: optimizer steps"
#: vega-embed options: the export menu (PNG/SVG, works offline), no links to online editors
EMBED_OPTIONS = {
    "renderer": "svg",
    "actions": {"export": True, "source": False, "compiled": False, "editor": False},
}


def _altair():
    try:
        import altair as alt
    except ImportError:  # pragma: no cover - depends on the install
        raise HarmonyError("charts need altair: pip install -e '.[notebooks]'") from None
    return alt


# ---- display ------------------------------------------------------------------------------
class _State:
    mode: str | None = None  #: the mode enabled by use_renderer
    previous: str | None = None  #: altair's renderer before ours, restored by "altair"


def use_renderer(mode: str | None = None) -> str:
    """Display altair charts in ``mode`` (see the module docstring); None reads
    ``HARMONY_CHARTS`` and defaults to ``"interactive"``. Returns the mode."""
    mode = (mode or os.environ.get(RENDERER_ENV) or "interactive").strip().lower()
    if mode not in RENDERERS:
        raise HarmonyError(
            f"unknown chart renderer {mode!r} (from {RENDERER_ENV} or the argument); "
            f"use one of {', '.join(RENDERERS)}"
        )
    alt = _altair()
    if mode == "altair":
        if _State.previous is not None:
            alt.renderers.enable(_State.previous)
    else:
        if not alt.renderers.active.startswith("harmony-"):
            _State.previous = alt.renderers.active
        alt.renderers.register(f"harmony-{mode}", functools.partial(mimebundle, mode=mode))
        alt.renderers.enable(f"harmony-{mode}")
    _State.mode = mode
    return mode


def mimebundle(spec: dict, mode: str = "interactive", picture: bool = True, **_) -> dict[str, str]:
    """What a notebook stores for the vega-lite ``spec``: HTML that draws it
    (``interactive``: with an SVG picture inside unless ``picture`` is False)
    or the picture alone (``static``). Extra keyword arguments (altair's
    renderer options) are ignored."""
    title = spec.get("title")
    text = title.get("text") if isinstance(title, dict) else title
    plain = f"<chart: {' '.join(text) if isinstance(text, list) else text or 'untitled'}>"
    if mode == "static":
        return {
            "text/html": f'<div class="harmony-chart">{_picture(spec)}</div>',
            "text/plain": plain,
        }
    return {"text/html": _interactive_html(spec, picture), "text/plain": plain}


class Displayable:
    """A chart shown by the current mode; ``picture=False`` leaves the SVG
    picture out of interactive HTML (for live widget outputs, which need a
    running kernel anyway: it saves a vl-convert render on every redraw)."""

    def __init__(self, chart, picture: bool = True):
        self.chart, self.picture = chart, picture

    def _repr_mimebundle_(self, include=None, exclude=None):
        mode = _State.mode or use_renderer()
        if mode == "altair":
            return self.chart._repr_mimebundle_(include, exclude)
        return mimebundle(self.chart.to_dict(), mode, self.picture)


def _vl_version() -> str:
    """vl-convert's name of the vega-lite version altair writes (``v6_4`` for 6.4.x)."""
    return "_".join(_altair().SCHEMA_VERSION.split(".")[:2])


def _picture(spec: dict) -> str:
    """An ``<img>`` of the chart, rendered by vl-convert: safe HTML that no
    sanitizer removes, so untrusted notebooks show it. A spec vl-convert cannot
    render gets a line saying so (the live chart, if scripts run, is unaffected)."""
    import vl_convert as vlc

    try:
        svg = vlc.vegalite_to_svg(spec, vl_version=_vl_version())
    except ValueError as err:
        return f"<pre>no picture of this chart: {html.escape(str(err)[:300])}</pre>"
    data = base64.b64encode(svg.encode()).decode()
    return f'<img src="data:image/svg+xml;base64,{data}" style="max-width: 100%" alt="chart">'


@functools.cache
def vega_script() -> str:
    """vega, vega-lite and vega-embed in one script, from vl-convert. Building
    it takes seconds, so it is kept in the user's cache folder per version."""
    import vl_convert as vlc

    version = _vl_version()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harmony"
    path = cache / f"vega-embed-vlc{vlc.__version__}-{version}.js"
    with contextlib.suppress(OSError):
        cached = path.read_text()
        if cached.rstrip().endswith(";") and "window.vegaEmbed" in cached:  # whole, not cut short
            return cached
    script = vlc.javascript_bundle(vl_version=version)
    with contextlib.suppress(OSError):  # a read-only home only costs the rebuild
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(script)
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return script


_NOTE = (
    '<div style="color: #888; font-size: 11px">A picture of the chart: run the cell, or '
    "trust the notebook, for tooltips and zoom.</div>"
)


def _interactive_html(spec: dict, picture: bool = True) -> str:
    """A div (holding the picture, if any) and a script that loads the inlined
    vega-embed once per page and replaces the div's content by the live chart."""
    div = f"harmony-chart-{uuid.uuid4().hex}"
    static = f'<div class="harmony-chart-static">{_picture(spec)}{_NOTE}</div>' if picture else ""
    # "</" would end the script element early; "<\/" is the same string in JSON and JavaScript
    spec_js = json.dumps(spec).replace("</", "<\\/")
    # The bundle declares top-level constants: it runs once per page, inside a function.
    return f"""<div class="harmony-chart" id="{div}">{static}</div>
<script type="text/javascript">
(function () {{
  var root = document.getElementById("{div}") || document.currentScript.previousElementSibling;
  if (!window.vegaEmbed) {{ (function () {{ {vega_script()}
  }})(); }}
  var live = root.appendChild(document.createElement("div"));
  window.vegaEmbed(live, {spec_js}, {json.dumps(EMBED_OPTIONS)})
    .then(function () {{
      var picture = root.querySelector(".harmony-chart-static");
      if (picture) picture.remove();
    }})
    .catch(function (err) {{
      var msg = document.createElement("pre");
      msg.style.color = "#c0392b";
      msg.textContent = "the interactive chart failed: " + err;
      root.appendChild(msg);
    }});
}})();
</script>"""


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
    alt = _altair()
    timeline = trace.timeline
    if color != "kind":  # bars merge and take their colour by this column instead
        timeline = timeline.assign(kind=[f"{color} {v}" for v in timeline[color]])
    df = coalesce(timeline, max_rows)
    df = df.assign(
        duration_ms=(df.end_s - df.start_s) * 1e3,
        layers=df["layers"].astype(str),
        means=df.kind.map(palette.KIND_WORDS).fillna(""),
    )
    if color == "kind":
        legend_color = alt.Color(
            "kind:N", scale=alt.Scale(**palette.kind_scale(df.kind)), legend=_kind_legend(alt)
        )
    else:
        legend_color = alt.Color(
            "kind:N",
            scale=alt.Scale(scheme="tableau10"),
            title=color,
            legend=alt.Legend(orient="bottom", columns=4),
        )
    lanes = sorted(df.lane.unique(), key=_lane_order)
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
            title=alt.Title(title, subtitle=[*_lines(subtitle), LANES]),
            width=width,
            height=max(120, 22 * len(lanes)),
        )
    )
    return (
        chart.add_params(alt.selection_interval(bind="scales", encodings=["x"])) if zoom else chart
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
    alt = _altair()
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
    alt = _altair()
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
    alt = _altair()
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
    alt = _altair()
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


if importlib.util.find_spec("altair") is not None:  # notebooks draw without internet from here on
    try:
        use_renderer()
    except HarmonyError as err:  # a mistyped HARMONY_CHARTS must not break the import
        warnings.warn(f"{err}; using the interactive renderer", stacklevel=2)
        use_renderer("interactive")
