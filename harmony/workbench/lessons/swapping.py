"""Lesson 1: why virtualized memory swaps too much."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import pandas as pd

from ...costs.hardware import Hardware
from ...costs.spec import ModelSpec
from ...engine import EmulatedDevice, Engine
from ...errors import HarmonyError
from ...graph import (
    DATA_IN,
    G_IN,
    G_OUT,
    OPT_IN,
    OPT_OUT,
    STASH_IN,
    STASH_OUT,
    W_IN,
)
from ...plan import Plan
from ...planner import simulate
from ...policies import get_policy, swap_volume
from ...trace import Trace
from .. import labels
from ..experiments import BASELINE, BASELINE_STATE, adamw, synthetic_batches
from ..training import build_model, lm_loss, torch_threads
from .common import (
    HOST_KINDS,
    LEGEND,
    _gb,
    policy_scale,
    with_link,
)


# ---- lesson 1: why virtualized memory swaps too much --------------------------------------
def model_overview(spec: ModelSpec, hw: Hardware) -> pd.DataFrame:
    """What training ``spec`` keeps in memory besides activations, against one GPU."""
    weights, grads, state = spec.weight_bytes(), spec.grad_bytes(), spec.optimizer_state_bytes()
    rows = [
        ("weights", weights),
        ("gradients", grads),
        ("optimizer state", state),
        ("weights + gradients + optimizer state", weights + grads + state),
        (f"memory of one GPU ({hw.name})", hw.gpu_memory),
    ]
    return pd.DataFrame([{"what": what, "GB": _gb(n)} for what, n in rows])


def weight_passes(plan: Plan) -> int:
    """How many times every pack's weights cross to a GPU in one iteration: once
    per microbatch for a policy without input-batch grouping, else once."""
    if not get_policy(plan.policy).PER_MICROBATCH:
        return 1
    return len(plan.bwd_microbatches())


def closed_form(spec: ModelSpec, plan: Plan) -> pd.DataFrame:
    """The bytes of one iteration of a one-GPU ``plan`` by transfer kind, from
    the formula (``formula``, ``GB``) and from :func:`harmony.swap_volume`
    (``library_GB``). W_IN = passes x (weights of the forward packs + weights of
    the backward packs); G_OUT = passes x gradients of the backward packs; the
    stashes and the data depend on the minibatch only. Where training state
    lives on the GPU (the baseline's ``gpu_gradients`` and ``gpu_optimizer``):
    G_IN = (passes - 1) x gradients (the accumulator back in for every
    microbatch but the first), OPT_IN = parameters + gradients + optimizer
    state, OPT_OUT = parameters + optimizer state (once per iteration). (A
    parameter tied across packs leaves once per microbatch in every policy;
    ``agrees`` says whether the formula and the library give the same number.)"""
    if plan.n_gpus != 1:
        raise HarmonyError("closed_form explains one-GPU plans; use harmony.swap_volume for more")
    n = weight_passes(plan)
    m, B = len(plan.bwd_microbatches()), plan.minibatch
    fwd_w = sum(spec.weight_bytes(*p) for p in plan.fwd_packs)
    bwd_w = sum(spec.weight_bytes(*p) for p in plan.bwd_packs)
    grads = sum(spec.grad_bytes(*p) for p in plan.bwd_packs)
    state = spec.optimizer_state_bytes()
    stashed = plan.stash_layers()
    out = sum(spec.input_bytes(layer, B) for layer in stashed if layer > 0)
    back = sum(spec.input_bytes(layer, B) for layer in stashed)
    data = spec.input_bytes(0, B) + spec.target_bytes(B)
    per = "microbatch" if n > 1 else "pass (grouped)"
    rows = [
        (
            W_IN,
            (
                f"{n} x ({_gb(fwd_w):.3g} GB forward packs + {_gb(bwd_w):.3g} GB backward "
                f"packs)  [once per {per}; {m} microbatches]"
            ),
            n * (fwd_w + bwd_w),
        ),
        (G_OUT, f"{n} x {_gb(grads):.3g} GB of gradients", n * grads),
        (
            STASH_OUT,
            f"inputs of {sum(1 for x in stashed if x > 0)} backward packs, {B} samples",
            out,
        ),
        (STASH_IN, f"the same, back, plus the minibatch itself for pack 0 ({B} samples)", back),
        (DATA_IN, f"inputs and labels of {B} samples", data),
    ]
    if plan.option("gpu_gradients"):
        rows.append(
            (G_IN, f"{n - 1} x {_gb(grads):.3g} GB of gradient accumulators", (n - 1) * grads)
        )
    if plan.option("gpu_optimizer"):
        rows += [
            (
                OPT_IN,
                f"{_gb(grads):.3g} GB parameters + {_gb(grads):.3g} GB gradients + "
                f"{_gb(state):.3g} GB optimizer state, once",
                2 * grads + state,
            ),
            (OPT_OUT, "the same but the gradients, back", grads + state),
        ]
    library = swap_volume(spec, plan)
    return pd.DataFrame(
        [
            {
                "kind": kind,
                "formula": text,
                "GB": _gb(value),
                "library_GB": _gb(library.get(kind, 0.0)),
                "agrees": math.isclose(value, library.get(kind, 0.0), rel_tol=1e-9),
            }
            for kind, text, value in rows
        ]
    )


def passes_counted(spec: ModelSpec, plan: Plan, trace: Trace) -> float:
    """How many times each pack's weights crossed to the GPU in ``trace`` (of
    ``plan`` on ``spec``): the W_IN bytes the simulator counted over one pass of
    the plan's packs."""
    one_pass = sum(spec.weight_bytes(*p) for p in (*plan.fwd_packs, *plan.bwd_packs))
    return trace.summary.bytes_by_kind.get(W_IN, 0.0) / one_pass


def bytes_table(
    spec: ModelSpec, plans: Mapping[str, Plan], traces: Mapping[str, Trace]
) -> pd.DataFrame:
    """Host<->GPU GB per transfer kind, per plan: the closed form and what the
    simulator counted when it played the graph (``simulated_GB``)."""
    rows = []
    for label, plan in plans.items():
        counted = traces[label].summary.bytes_by_kind
        for kind, value in swap_volume(spec, plan).items():
            if kind in HOST_KINDS:
                rows.append(
                    {
                        "plan": label,
                        "kind": kind,
                        "GB": _gb(value),
                        "simulated_GB": _gb(counted.get(kind, 0.0)),
                    }
                )
    return pd.DataFrame(rows)


def bytes_chart(df: pd.DataFrame, title: str = ""):
    """Bars of GB per transfer kind, one bar per plan, on a log scale."""
    import altair as alt

    data = df[df["GB"] > 0]
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X(
                "kind:N",
                sort=list(HOST_KINDS),
                title="what crosses the host↔GPU link (task kind)",
                axis=alt.Axis(labelAngle=-30, labelAlign="right"),
            ),
            xOffset=alt.XOffset("plan:N", sort=list(dict.fromkeys(data["plan"]))),
            # unstacked: on a log scale every bar must start at the axis
            y=alt.Y(
                "GB:Q", scale=alt.Scale(type="log"), title="GB per iteration (log)", stack=None
            ),
            color=alt.Color(
                "plan:N", title="plan", legend=LEGEND, scale=policy_scale(data["plan"])
            ),
            tooltip=[
                alt.Tooltip("plan:N", title="plan"),
                alt.Tooltip("kind:N", title="task kind"),
                alt.Tooltip("GB:Q", format=".4g", title="GB per iteration"),
            ],
        )
        .properties(title=title, width=420, height=240)
    )


def link_sweep(
    spec: ModelSpec, hw: Hardware, plans: Mapping[str, Plan], rates: Sequence[str]
) -> pd.DataFrame:
    """Each plan simulated with every host link at each rate of ``rates``
    (``"paper"``: as the preset has it): iteration time and what limits it."""
    rows = []
    for rate in rates:
        server = with_link(hw, rate)
        for label, plan in plans.items():
            s = simulate(spec, server, plan).summary
            rows.append(
                {
                    "link": rate,
                    "link_GBps": server.h2d / 1e9,
                    "plan": label,
                    "iteration_s": s.iteration_s,
                    "limited_by": s.lower_bound_by,
                }
            )
    return pd.DataFrame(rows)


def link_chart(df: pd.DataFrame, title: str = ""):
    """Iteration time against the host link rate, one line per plan."""
    import altair as alt

    return (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "link_GBps:Q",
                scale=alt.Scale(type="log", nice=False),
                title="host<->GPU link (GB/s, log)",
            ),
            y=alt.Y("iteration_s:Q", title="iteration time (s, simulated)"),
            color=alt.Color("plan:N", title="plan", legend=LEGEND, scale=policy_scale(df["plan"])),
            tooltip=labels.tooltips(df, ["plan", "link", "iteration_s", "limited_by"]),
        )
        .properties(title=title, width=420, height=240)
    )


def engine_bytes(
    policies: Sequence[str],
    minibatch: int = 16,
    microbatch: int = 2,
    memory: str = "4MB",
    bandwidth: str = "1GB/s",
    seed: int = 0,
    threads: int | None = 1,
) -> pd.DataFrame:
    """A real step of the zoo's ``gpt2-tiny`` under each policy (one layer per
    pack) on an emulated GPU, the second of two: bytes the engine moved over the
    link by kind, next to the closed form on the spec the engine built for the
    model; the baseline with its gradient sums and optimizer on the GPU, as in
    the lesson."""
    (x,), y = synthetic_batches(1, minibatch, seed=seed + 1)[0]
    rows = []
    with torch_threads(threads):
        for policy in policies:
            model = build_model("gpt2-tiny", seed, dropout=0.0)
            state = BASELINE_STATE if policy == BASELINE else {}
            plan = Plan.uniform(policy, 1, minibatch, microbatch, len(model), 1, **state)
            engine = Engine(
                model,
                adamw(1e-3),
                lm_loss,
                minibatch_size=minibatch,
                plan=plan,
                device=EmulatedDevice(memory=memory, h2d=bandwidth, d2h=bandwidth),
                seed=seed,
            )
            # two steps, the second counted: AdamW creates its state in its first step, so
            # only from the second on does an optimizer step on the GPU bring the state in
            for _ in range(2):
                engine.step(x, y)
            moved = engine.trace.summary.bytes_by_kind
            for kind, value in swap_volume(engine.spec, plan).items():
                if kind in HOST_KINDS:
                    rows.append(
                        {
                            "policy": policy,
                            "kind": kind,
                            "closed_form_KB": value / 1e3,
                            "measured_KB": moved.get(kind, 0.0) / 1e3,
                        }
                    )
    return pd.DataFrame(rows)
