"""What several lessons share: labels, server variants, playing plans, a
summary table, and :func:`try_this` (a computation behind ipywidgets controls)."""

from __future__ import annotations

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
def try_this(compute: Callable[..., Any], controls: Mapping[str, Any], button: str | None = None):
    """``controls`` (ipywidgets by argument name) over an output area that shows
    ``compute(**values)`` again on every change, or when ``button`` (its label)
    is pressed, for computations that take seconds. The area starts empty: the
    notebook shows the result for its parameters above it, and a batch run
    (papermill) computes nothing here."""
    import ipywidgets as w
    from IPython.display import display

    out = w.Output()

    def refresh(_=None) -> None:
        values = {name: c.value for name, c in controls.items()}
        with out:
            out.clear_output(wait=True)
            try:
                display(compute(**values))
            except HarmonyError as e:  # a setting that cannot run says why
                print(f"cannot run this: {e}")

    boxes = list(controls.values())
    if button:
        run = w.Button(description=button, button_style="primary")
        run.on_click(refresh)
        boxes.append(run)
        hint = f"Set the controls and press <b>{button}</b>; the result appears below."
    else:
        for c in controls.values():
            c.observe(refresh, names="value")
        hint = "Change a control; the result appears below."
    return w.VBox(
        [w.HBox(boxes, layout=w.Layout(flex_flow="row wrap")), w.HTML(f"<i>{hint}</i>"), out]
    )
