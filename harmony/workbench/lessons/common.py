"""What several lessons share: labels, server variants, playing plans, a
summary table, and :func:`try_this` (a computation behind ipywidgets controls)."""

from __future__ import annotations

import html
from dataclasses import replace
from typing import Any, Callable, Mapping

import pandas as pd

from ...costs.hardware import Hardware, parse_rate
from ...costs.spec import ModelSpec
from ...errors import HarmonyError
from ...graph import (
    BWD,
    DATA_IN,
    FWD,
    FWDBWD,
    G_IN,
    G_OUT,
    OPT_IN,
    OPT_OUT,
    REC,
    STASH_IN,
    STASH_OUT,
    W_IN,
)
from ...plan import Plan
from ...planner import simulate
from ...planner.systems import layer_swap_plans
from ...trace import Trace
from .. import palette
from ..controls import shown
from ..display import live_bundle, live_html, loader_bundle
from ..experiments import ABLATION, BASELINE

#: Harmony's two placements: packs round-robin over the GPUs, or every GPU runs every pack
PIPELINE, DATA_PARALLEL = "harmony-pp", "harmony-dp"
#: the transfers between host and GPU memory, in the order the lessons introduce them (the
#: last three only where training state lives on the GPU, as in the baseline)
HOST_KINDS = (W_IN, G_OUT, STASH_OUT, STASH_IN, DATA_IN, G_IN, OPT_IN, OPT_OUT)
#: GPU compute task kinds (REC is the recompute half of a backward task)
COMPUTE_KINDS = (FWD, FWDBWD, REC, BWD)
#: legends under the charts, wide enough for a policy's name and what it is
LEGEND = {"orient": "bottom", "labelLimit": 400}


def _gb(n: float) -> float:
    """Bytes in GB (10^9)."""
    return float(n) / 1e9


def policy_label(policy: str) -> str:
    """A policy name with what it is, for legends."""
    if policy == BASELINE:
        return f"{policy} (per-layer swapping, vDNN / LMS)"
    if policy == ABLATION:
        return f"{policy} (Harmony without grouping)"
    return policy


def lesson_plan(
    policy: str,
    spec: ModelSpec,
    hw: Hardware,
    n_gpus: int,
    minibatch: int,
    microbatch: int,
    layers_per_pack: int,
) -> Plan:
    """The plan a lesson plays for ``policy`` on ``n_gpus`` GPUs: Harmony's (and
    the ablation's) on uniform packs of ``layers_per_pack`` layers; the
    :data:`BASELINE` as its own chooser builds it (one layer at a time, every
    layer's input swapped, the next layer prefetched, gradient sums and the
    optimizer on the GPU), at the same ``microbatch``."""
    if policy == BASELINE:
        return layer_swap_plans(spec, hw, minibatch, n_gpus).plan_at(microbatch)
    return Plan.uniform(policy, n_gpus, minibatch, microbatch, len(spec), layers_per_pack)


def policy_scale(labels) -> dict[str, list[str]]:
    """An altair colour scale for series named by policy (or ``policy (what it
    is)``): each in its policy's colour from the project's palette."""
    domain = list(dict.fromkeys(labels))
    return {"domain": domain, "range": [palette.color(label.split(" (")[0]) for label in domain]}


def with_link(hw: Hardware, rate: str) -> Hardware:
    """``hw`` with every host<->GPU link (and the shared uplink) at ``rate``
    (``"paper"``: as the preset has it)."""
    if rate == "paper":
        return hw
    r = parse_rate(rate)
    return replace(hw, name=f"{hw.name}@{rate}", h2d=r, d2h=r, uplink=r)


def with_cpu(hw: Hardware, rate: str) -> Hardware:
    """``hw`` with the CPU optimizer streaming ``rate`` (``"paper"``: as the preset has it)."""
    if rate == "paper":
        return hw
    return replace(hw, name=f"{hw.name}+cpu@{rate}", cpu_update_bandwidth=parse_rate(rate))


def play(spec: ModelSpec, hw: Hardware, plans: Mapping[str, Plan]) -> dict[str, Trace]:
    """Simulate each plan; the traces by the same labels."""
    return {label: simulate(spec, hw, plan) for label, plan in plans.items()}


def compute_s(trace: Trace) -> float:
    """Seconds the busiest GPU spends computing in one iteration."""
    tl = trace.timeline
    compute = tl[tl["kind"].isin(COMPUTE_KINDS)]
    return float((compute["end_s"] - compute["start_s"]).groupby(compute["device"]).sum().max())


def summary_table(traces: Mapping[str, Trace]) -> pd.DataFrame:
    """One row per trace: iteration time, samples/s, host<->GPU GB, peak GPU
    memory, whether it fits, what bounds the iteration from below, the
    busiest GPU's compute time, and ``link_bound_below_GBps``: the host link rate
    below which the link, not compute, sets the pace (the GB the busiest
    direction of one GPU's link carries over the compute seconds)."""
    rows = []
    for label, trace in traces.items():
        s, tl = trace.summary, trace.timeline
        on_link = tl[tl["kind"].isin(HOST_KINDS)]
        direction = on_link["lane"].str.rpartition(".")[2]
        busiest = on_link.groupby([on_link["device"], direction])["bytes"].sum().max()
        busy = compute_s(trace)
        rows.append(
            {
                "plan": label,
                "policy": s.policy,
                "iteration_s": s.iteration_s,
                "samples_per_s": s.samples_per_s,
                "swap_gb": _gb(s.swap_bytes),
                "peak_gb": _gb(max(s.peak_memory.values())),
                "fits": s.fits,
                "limited_by": s.lower_bound_by,
                "compute_s": busy,
                "link_bound_below_GBps": _gb(busiest) / busy,
            }
        )
    return pd.DataFrame(rows)


# ---- interactive --------------------------------------------------------------------------
def readable(df: pd.DataFrame):
    """A table for reading: numbers to 3 significant digits, headings that wrap at
    underscores, no index, inside a box that scrolls sideways rather than cut a column."""
    from IPython.display import HTML

    numbers = df.select_dtypes("number").columns.difference(df.select_dtypes("bool").columns)
    styler = (
        df.rename(columns=lambda c: str(c).replace("_", " "))
        .style.format({str(c).replace("_", " "): "{:.3g}" for c in numbers})
        .hide(axis="index")
        .set_table_styles(
            [
                {
                    "selector": "th",
                    "props": "white-space: normal; max-width: 9em; text-align: right;",
                }
            ]
        )
    )
    return HTML(f'<div style="overflow-x: auto; max-width: 100%">{styler.to_html()}</div>')


def _bundle(result) -> dict:
    """The mime bundle of what :func:`try_this` shows: a chart without vega's script
    (the widget loads it once), a table :func:`readable`, anything else as IPython
    shows it (HTML as a :func:`~..display.live_html`: a chart after it is drawn in
    its place, not over an older chart)."""
    from IPython.core.formatters import format_display_data

    if hasattr(result, "to_dict") and hasattr(result, "mark_point"):  # an altair chart
        return live_bundle(result)
    if isinstance(result, pd.DataFrame):
        result = readable(result)
    bundle = format_display_data(result)[0]
    return live_html(bundle["text/html"]) if "text/html" in bundle else bundle


def try_this(compute: Callable[..., Any], controls: Mapping[str, Any], button: str | None = None):
    """``controls`` (ipywidgets by argument name) over an output area that shows
    ``compute(**values)`` for the controls as they are, at once, then again on
    every change, or when ``button`` (its label) is pressed, for computations that
    take seconds; each result replaces the last in one step. A table is shown
    :func:`readable`; the controls' labels are as wide as their text."""
    import ipywidgets as w
    from IPython.display import HTML

    out = w.Output()
    loader = w.Output(layout=w.Layout(height="0px", overflow="hidden"))
    loader.outputs = (shown(loader_bundle()),)

    def refresh(_=None) -> None:
        values = {name: c.value for name, c in controls.items()}
        try:
            result = compute(**values)
        except HarmonyError as e:  # a setting that cannot run says why
            result = HTML(f"<pre>cannot run this: {html.escape(str(e))}</pre>")
        out.outputs = (shown(_bundle(result)),)

    for c in controls.values():  # "per pack (H)", not "per pack (…"
        if hasattr(c, "style") and hasattr(c.style, "description_width"):
            c.style.description_width = "initial"
    boxes = list(controls.values())
    if button:
        run = w.Button(description=button, button_style="primary")
        run.on_click(refresh)
        boxes.append(run)
        hint = f"Set the controls and press <b>{button}</b>; the result below follows."
    else:
        for c in controls.values():
            c.observe(refresh, names="value")
        hint = "Change a control; the result below follows."
    refresh()
    return w.VBox(
        [
            w.HBox(boxes, layout=w.Layout(flex_flow="row wrap")),
            w.HTML(f"<i>{hint}</i>"),
            out,
            loader,
        ]
    )
