"""Interactive explorers for JupyterLab: set a plan with widgets, see what it does.

* :class:`PackExplorer` simulates one plan (pack size, microbatch sizes,
  options) and, for comparison, the other policies on the same packs.
* :class:`RunForReal` trains a small GPT-2 of the zoo for a few steps with the
  real :class:`~harmony.engine.engine.Engine` on an emulated GPU and simulates
  the same plan from a profile of the same model.

Both hold their controls as ipywidgets attributes (set ``.value`` from code
too); ``compute()`` reads them and returns a result, ``chart()`` draws it with
altair and ``widget()`` lays the controls out over an output that shows the
chart and a table. Infeasible settings never raise: the result's ``problem``
says in words what is wrong, and the chart shows what can be shown.

The policies offered, and the baselines compared against, are those of
:mod:`harmony.policies` (a policy added there shows up here by itself).

Needs the ``notebooks`` extra (ipywidgets, altair, vl-convert).
"""

from __future__ import annotations

import contextlib
import functools
import math
import textwrap
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from ..costs import zoo
from ..costs.catalog import SOURCES, known_models, model_spec
from ..costs.hardware import PRESETS, Hardware, preset
from ..costs.spec import ModelSpec
from ..engine import EmulatedDevice, Engine
from ..engine.profiler import default_sizes, profile
from ..errors import HarmonyError
from ..plan import DEFAULT_OPTIONS, Plan, uniform_packs
from ..planner import simulate
from ..policies import get_policy, names
from ..trace import Trace
from .charts import (
    MAX_ROWS,
    Displayable,
    _altair,
    memory_chart,
    plan_notation,
    policy_bars,
    timeline_chart,
)
from .training import lm_loss, torch_threads

try:
    import ipywidgets as w
except ImportError:  # pragma: no cover - depends on the install
    raise ImportError(
        "harmony.workbench.widgets needs ipywidgets: pip install -e '.[notebooks]'"
    ) from None

#: the largest task graph simulated interactively (about a second per policy)
MAX_TASKS = 20_000
#: tasks per compute op (its weight, activation and gradient transfers): 2 to 3.6 measured
TASKS_PER_OP = 4


def baselines() -> list[str]:
    """The policies a Harmony plan is compared against: every policy that is not Harmony's own."""
    own = set(names(role="harmony"))
    return [n for n in names() if n not in own]


def default_baseline() -> str:
    """The paper's baseline: Harmony without input-batch grouping (the first
    ablation) when there is one, else the first other policy."""
    return (names(role="ablation") or baselines() or names())[0]


# ---- plans and simulations -------------------------------------------------------------
def make_plan(
    policy: str,
    n_gpus: int,
    minibatch: int,
    fwd_microbatch: int,
    bwd_microbatch: int,
    num_layers: int,
    pack_size: int,
    offload_activations: bool = False,
    prefetch_packs: int = 2,
) -> Plan:
    """Backward packs of ``pack_size`` layers; forward packs on the same
    boundaries (all but the fused last pack). Options equal to their defaults
    are left out."""
    bwd = uniform_packs(0, num_layers, pack_size)
    options = {"offload_activations": offload_activations, "prefetch_packs": prefetch_packs}
    return Plan(
        policy,
        n_gpus,
        minibatch,
        fwd_microbatch,
        bwd_microbatch,
        bwd[:-1],
        bwd,
        {k: v for k, v in options.items() if v != DEFAULT_OPTIONS[k]},
    )


def estimated_tasks(plan: Plan) -> int:
    """An upper estimate of the tasks in ``plan``'s graph, without building it."""
    ops = len(plan.fwd_microbatches()) * len(plan.fwd_packs) + len(plan.bwd_microbatches()) * len(
        plan.bwd_packs
    )
    return TASKS_PER_OP * ops


def _over_capacity(trace: Trace) -> list[str]:
    """The devices whose peak exceeds their capacity, the furthest over first."""
    peak, cap = trace.summary.peak_memory, trace.summary.memory_capacity
    return sorted((d for d in cap if peak.get(d, 0.0) > cap[d]), key=lambda d: cap[d] - peak[d])


def out_of_memory(trace: Trace) -> str | None:
    """Which GPU runs out of memory and by how much, or None when the trace fits."""
    peak, cap = trace.summary.peak_memory, trace.summary.memory_capacity
    over = _over_capacity(trace)
    if not over:
        return None
    d = over[0]
    also = f"; {', '.join(sorted(over[1:]))} as well" if len(over) > 1 else ""
    return (
        f"{d} runs out of memory: it needs {peak[d] / 1e9:.2f} GB at peak but has "
        f"{cap[d] / 1e9:.2f} GB ({(peak[d] - cap[d]) / 1e9:.2f} GB over){also}. "
        "Try smaller microbatches or packs."
    )


def play(spec: ModelSpec, hardware: Hardware, plan: Plan) -> tuple[Trace | None, str | None]:
    """Simulate ``plan`` if it is valid and small enough: ``(trace, problem)``.
    The trace is None when the plan could not be simulated; the problem is None
    when the plan runs and fits in memory."""
    try:
        plan.validate(len(spec))
        tasks = estimated_tasks(plan)
        if tasks > MAX_TASKS:
            return None, (
                f"about {tasks:,} tasks ({len(plan.bwd_microbatches())} backward microbatches "
                f"x {len(plan.bwd_packs)} packs, plus forward): more than the {MAX_TASKS:,} "
                "simulated interactively. Use larger microbatches or packs, or "
                "harmony.simulate() in a script."
            )
        trace = simulate(spec, hardware, plan)
    except HarmonyError as err:
        return None, str(err)
    return trace, out_of_memory(trace)


@functools.lru_cache(maxsize=32)
def _spec(model: str, source: str) -> ModelSpec:
    return model_spec(model, source)


# ---- chart helpers ------------------------------------------------------------------------
def thin_memory(trace: Trace, max_rows: int = MAX_ROWS) -> Trace:
    """``trace`` with its memory steps cut to at most ``max_rows`` points, for
    :func:`~harmony.workbench.charts.memory_chart`: per time bin and device, the highest
    level reached in the bin (at the bin's start, so peaks stay visible) and the
    level it ends on."""
    if sum(len(steps) for steps in trace.memory.values()) <= max_rows:
        return trace
    times = [t for steps in trace.memory.values() for t, _ in steps]
    t0, bins = min(times), max(1, max_rows // (2 * len(trace.memory)))
    width = (max(times) - t0) / bins or 1.0
    thin = {}
    for device, steps in trace.memory.items():
        per_bin: dict[
            int, tuple[float, tuple[float, float]]
        ] = {}  # bin -> (highest level, last step)
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
    alt = _altair()
    text = "\n".join(textwrap.wrap("Problem: " + problem, width // 7))
    return (
        alt.Chart(pd.DataFrame({"text": [text]}))
        .mark_text(align="left", baseline="top", lineBreak="\n", color="#c0392b", fontSize=13)
        .encode(text="text:N", x=alt.value(0), y=alt.value(0))
        .properties(
            width=width, height=18 * (text.count("\n") + 1), view=alt.ViewBackground(stroke=None)
        )
    )


# ---- the explorers ----------------------------------------------------------------------
class _Explorer:
    """Controls -> ``compute()`` -> ``chart()``, shown in ``self.output``."""

    output: w.Output
    result = None
    _box: w.Widget | None = None

    def controls(self) -> list[w.Widget]:
        raise NotImplementedError

    def compute(self):
        raise NotImplementedError

    def chart(self, result=None):
        raise NotImplementedError

    def _wire(self) -> None:
        """Connect the controls to :meth:`render` (once, when first shown)."""
        raise NotImplementedError

    def render(self) -> None:
        """Compute and replace what ``self.output`` shows: the chart and the table."""
        result = self.compute()
        self.output.outputs = ()
        # a live output needs the kernel anyway: no static picture (it costs a render per change)
        self.output.append_display_data(Displayable(self.chart(result), picture=False))
        self.output.append_display_data(result.table())

    def widget(self) -> w.Widget:
        """The controls in a grid over the live output (for JupyterLab)."""
        if self._box is None:
            grid = w.GridBox(
                self.controls(), layout=w.Layout(grid_template_columns="repeat(3, 330px)")
            )
            self._box = w.VBox([grid, self.output])
            self._wire()
        return self._box

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)


_STYLE = {"description_width": "130px"}


def _int_text(value: int, description: str, top: int = 4096) -> w.BoundedIntText:
    return w.BoundedIntText(value=value, min=1, max=top, description=description, style=_STYLE)


@dataclass
class Exploration:
    """What :meth:`PackExplorer.compute` found."""

    plan: Plan | None  #: None when the model's spec could not be loaded
    trace: Trace | None  #: None when the plan is invalid or too large to simulate
    #: one row per policy on the same packs: policy, chosen, fwd/bwd microbatch,
    #: iteration_s, samples_per_s, swap_gb, peak_gb, fits, status ("fits",
    #: "does not fit: ...", "not run: ..."), note (why a row could not be
    #: simulated or fit), speedup_vs_baseline (the baseline's time / this
    #: one's), swap_ratio_vs_baseline (the baseline's swap volume / this one's)
    comparison: pd.DataFrame
    problem: str | None  #: why the chosen plan cannot run, in words
    baseline: str = ""  #: the policy the ratios compare against

    @property
    def headline(self) -> str:
        """One line: the chosen plan's time and swap volume against the
        baseline's (and the fastest policy that fits, when that is another)."""
        if self.plan is None:
            return f"nothing to simulate: {self.problem}"
        return headline(self.comparison, self.plan.policy, self.baseline)

    def table(self):
        """The comparison for reading: units in the headings, rounded, the
        chosen row in bold, plans that do not fit in grey, notes wrapped
        (a pandas Styler)."""
        return comparison_table(self.comparison, self.baseline)

    def to_dict(self) -> dict:
        """JSON-ready: the plan, the problem, the headline, the comparison rows and the
        trace's main numbers."""
        s = self.trace.summary if self.trace is not None else None
        return {
            "plan": self.plan.to_dict() if self.plan else None,
            "problem": self.problem,
            "headline": self.headline,
            "baseline": self.baseline,
            "iteration_s": s and s.iteration_s,
            "swap_bytes": s and s.swap_bytes,
            "peak_memory": s and s.peak_memory,
            "comparison": _records(self.comparison),
        }


def _records(df: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        for row in df.to_dict("records")
    ]


class PackExplorer(_Explorer):
    """Pack size and microbatch sizes of one plan, simulated against every
    other policy of :mod:`harmony.policies` on the same packs (a policy that
    runs each microbatch forward then backward uses the backward microbatch
    for both), on the same GPU count. ``baseline`` (default
    :func:`default_baseline`) is the one the headline and the ratios compare to.

    The widget re-draws on every change; plans over :data:`MAX_TASKS` tasks
    are not simulated (``problem`` says so)."""

    def __init__(
        self,
        model: str = "bert-large",
        source: str = "auto",
        hardware: str = "paper-4x1080ti",
        policy: str = "harmony-pp",
        n_gpus: int | None = None,
        minibatch: int = 32,
        fwd_microbatch: int = 4,
        bwd_microbatch: int = 4,
        pack_size: int = 2,
        offload_activations: bool = False,
        prefetch_packs: int = 2,
        baseline: str | None = None,
    ):
        gpus = preset(hardware).n_gpus
        self.model = w.Dropdown(
            options=known_models(), value=model, description="model", style=_STYLE
        )
        self.source = w.Dropdown(
            options=SOURCES, value=source, description="spec source", style=_STYLE
        )
        self.hardware = w.Dropdown(
            options=list(PRESETS), value=hardware, description="hardware", style=_STYLE
        )
        self.policy = w.Dropdown(options=names(), value=policy, description="policy", style=_STYLE)
        self.baseline = w.Dropdown(
            options=baselines(),
            value=baseline or default_baseline(),
            description="compared with",
            style=_STYLE,
        )
        self.n_gpus = w.IntSlider(
            value=n_gpus or gpus,
            min=1,
            max=gpus,
            description="GPUs",
            continuous_update=False,
            style=_STYLE,
        )
        self.minibatch = _int_text(minibatch, "minibatch")
        self.fwd_microbatch = _int_text(fwd_microbatch, "fwd microbatch")
        self.bwd_microbatch = _int_text(bwd_microbatch, "bwd microbatch")
        self.pack_size = w.IntSlider(
            value=pack_size,
            min=1,
            max=max(pack_size, 64),
            description="layers per pack",
            continuous_update=False,
            style=_STYLE,
        )
        self.offload_activations = w.Checkbox(
            value=offload_activations, description="offload activations"
        )
        self.prefetch_packs = w.IntSlider(
            value=prefetch_packs,
            min=1,
            max=3,
            description="prefetch packs",
            continuous_update=False,
            style=_STYLE,
        )
        self.output = w.Output()
        self.hardware.observe(self._hardware_changed, "value")
        self.model.observe(self._model_changed, "value")
        self.source.observe(self._model_changed, "value")
        self.policy.observe(self._policy_changed, "value")
        self._model_changed()
        self._policy_changed()

    def controls(self) -> list[w.Widget]:
        return [
            self.model,
            self.source,
            self.hardware,
            self.policy,
            self.baseline,
            self.n_gpus,
            self.minibatch,
            self.fwd_microbatch,
            self.bwd_microbatch,
            self.pack_size,
            self.offload_activations,
            self.prefetch_packs,
        ]

    # keep the controls consistent with each other
    def _hardware_changed(self, _=None) -> None:
        self.n_gpus.max = preset(self.hardware.value).n_gpus

    def _model_changed(self, _=None) -> None:
        with contextlib.suppress(HarmonyError):  # an unknown spec is reported by compute()
            self.pack_size.max = len(_spec(self.model.value, self.source.value))

    def _policy_changed(self, _=None) -> None:
        one_size = get_policy(self.policy.value).PER_MICROBATCH
        self.fwd_microbatch.disabled = one_size
        self.fwd_microbatch.tooltip = (
            f"{self.policy.value} uses the bwd microbatch for both" if one_size else ""
        )

    def _wire(self) -> None:
        for control in self.controls():
            control.observe(lambda _: self.render(), "value")
        self.render()

    # ---- compute and draw ------------------------------------------------------------------
    def plan_for(self, policy: str, num_layers: int) -> Plan:
        """The controls' plan under ``policy`` (one microbatch size per policy
        that runs each microbatch forward then backward: the backward one)."""
        ub = self.bwd_microbatch.value
        uf = ub if get_policy(policy).PER_MICROBATCH else self.fwd_microbatch.value
        return make_plan(
            policy,
            self.n_gpus.value,
            self.minibatch.value,
            uf,
            ub,
            num_layers,
            self.pack_size.value,
            self.offload_activations.value,
            self.prefetch_packs.value,
        )

    def compute(self) -> Exploration:
        """Simulate the chosen plan and one plan per other policy on the same packs."""
        baseline = self.baseline.value
        try:
            spec = _spec(self.model.value, self.source.value)
        except HarmonyError as err:
            self.result = Exploration(
                None, None, pd.DataFrame(columns=_COMPARISON_COLUMNS), str(err), baseline
            )
            return self.result
        hw = preset(self.hardware.value)
        chosen = self.policy.value
        played = {}  # policy -> (plan, trace, problem)
        for policy in [chosen] + [p for p in names() if p != chosen]:
            plan = self.plan_for(policy, len(spec))
            played[policy] = (plan, *play(spec, hw, plan))
        rows = pd.DataFrame([_row(*played[p], p == chosen) for p in played])
        plan, trace, problem = played[chosen]
        self.result = Exploration(plan, trace, _versus(rows, baseline), problem, baseline)
        return self.result

    def chart(self, result: Exploration | None = None):
        """Headline, problem (if any), swap timeline, memory per GPU vs
        capacity, and iteration time and swap volume of every policy."""
        alt = _altair()
        r = result or self.result or self.compute()
        parts = [problem_chart(r.problem)] if r.problem else []
        if r.trace is not None:
            title = f"{r.plan.describe()}: {r.trace.iteration_s:.3g} s per iteration"
            # one time axis: zooming the timeline zooms the memory too
            parts.append(
                alt.vconcat(
                    timeline_chart(r.trace, title=title, subtitle=plan_notation(r.plan)),
                    memory_chart(thin_memory(r.trace)),
                ).resolve_scale(x="shared", color="independent")
            )
        shown = r.comparison
        if len(shown):
            chosen = r.plan.policy if r.plan else None
            parts.append(
                alt.hconcat(
                    policy_bars(
                        shown,
                        "iteration_s",
                        "time per iteration (shorter is faster)",
                        "seconds per iteration",
                        chosen,
                    ),
                    policy_bars(
                        shown,
                        "swap_gb",
                        "bytes over host↔GPU links per iteration",
                        "GB per iteration",
                        chosen,
                    ),
                )
            )
        subtitle = (
            f"the same packs under every policy; ratios against {r.baseline}" if r.baseline else ""
        )
        return (
            alt.vconcat(*parts)
            .resolve_scale(color="independent")
            .properties(
                title=alt.Title(r.headline, subtitle=subtitle, anchor="start", fontSize=16)
            )
        )


def _status(trace: Trace | None, problem: str | None) -> str:
    """A row's status in a few words: "fits", "does not fit: <device> needs <GB> more"
    or "not run: <the problem's first sentence>"."""
    if trace is None:
        first = (problem or "").split(". ")[0]
        return "not run: " + (first if len(first) <= 60 else first[:59] + "…")
    over = _over_capacity(trace)
    if not over:
        return "fits"
    d = over[0]
    need = (trace.summary.peak_memory[d] - trace.summary.memory_capacity[d]) / 1e9
    return f"does not fit: {d} needs {need:.2f} GB more"


def _row(plan: Plan, trace: Trace | None, problem: str | None, chosen: bool) -> dict:
    row = {
        "policy": plan.policy,
        "chosen": chosen,
        "fwd_microbatch": plan.fwd_microbatch,
        "bwd_microbatch": plan.bwd_microbatch,
        "iteration_s": math.nan,
        "samples_per_s": math.nan,
        "swap_gb": math.nan,
        "peak_gb": math.nan,
        "fits": False,
        "status": _status(trace, problem),
        "note": problem,
    }
    if trace is not None:
        s = trace.summary
        row.update(
            iteration_s=s.iteration_s,
            samples_per_s=s.samples_per_s,
            swap_gb=s.swap_bytes / 1e9,
            peak_gb=max(s.peak_memory.values()) / 1e9,
            fits=bool(s.fits),
        )
    return row


def _versus(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    base = df[df.policy == baseline]
    t, gb = (base.iteration_s.iloc[0], base.swap_gb.iloc[0]) if len(base) else (math.nan, math.nan)
    return df.assign(
        speedup_vs_baseline=t / df.iteration_s, swap_ratio_vs_baseline=gb / df.swap_gb
    )


_COMPARISON_COLUMNS = [
    "policy",
    "chosen",
    "fwd_microbatch",
    "bwd_microbatch",
    "iteration_s",
    "samples_per_s",
    "swap_gb",
    "peak_gb",
    "fits",
    "status",
    "note",
    "speedup_vs_baseline",
    "swap_ratio_vs_baseline",
]


def _times(ratio: float, more: str, less: str) -> str:
    """2.96 -> "3x <more>", 0.5 -> "2x <less>"."""
    if not math.isfinite(ratio) or ratio <= 0:
        return f"no comparable {more.split()[-1]}"
    return f"{ratio:.2g}x {more}" if ratio >= 1 else f"{1 / ratio:.2g}x {less}"


def headline(comparison: pd.DataFrame, chosen: str, baseline: str) -> str:
    """E.g. "harmony-pp: 3.1 s/iter, 5.63 GB swapped: 1.5x faster and 6x fewer
    bytes than harmony-no-grouping", from :class:`Exploration`'s comparison."""
    rows = comparison.set_index("policy")
    me = rows.loc[chosen]
    if math.isnan(me.iteration_s):
        return f"{chosen}: {me.status}"
    text = f"{chosen}: {me.iteration_s:.3g} s/iter, {me.swap_gb:.3g} GB swapped"
    if not me.fits:
        return f"{text}, {me.status}"
    base = rows.loc[baseline] if baseline in rows.index and baseline != chosen else None
    if base is not None and math.isnan(base.iteration_s):
        text += f"; {baseline}: {base.status}"
    elif base is not None:
        text += (
            f": {_times(base.iteration_s / me.iteration_s, 'faster', 'slower')} and "
            f"{_times(base.swap_gb / me.swap_gb, 'fewer bytes', 'more bytes')} than {baseline}"
            + ("" if base.fits else f" (which {base.status.replace(':', ',', 1)})")
        )
    fitting = rows[rows.fits.astype(bool)].sort_values("iteration_s")
    if (
        len(fitting)
        and fitting.index[0] != chosen
        and fitting.iloc[0].iteration_s < me.iteration_s
    ):
        text += (
            f"; fastest that fits: {fitting.index[0]} at {fitting.iloc[0].iteration_s:.3g} s/iter"
        )
    return text


#: comparison column -> (heading, number format)
_TABLE_COLUMNS = {
    "policy": ("policy", None),
    "microbatches": ("uF / uB", None),
    "iteration_s": ("s / iter", "{:.3g}"),
    "samples_per_s": ("samples / s", "{:.3g}"),
    "swap_gb": ("swap GB / iter", "{:.3g}"),
    "peak_gb": ("peak GB / GPU", "{:.2f}"),
    "speedup_vs_baseline": ("× faster", "{:.2f}"),
    "swap_ratio_vs_baseline": ("× fewer bytes", "{:.2f}"),
    "note": ("why it cannot run", None),
}


def comparison_table(comparison: pd.DataFrame, baseline: str = ""):
    """A pandas Styler of an explorer's comparison: see :meth:`Exploration.table`."""
    df = comparison.assign(
        microbatches=[
            f"{f} / {b}" for f, b in zip(comparison.fwd_microbatch, comparison.bwd_microbatch)
        ]
    )
    df = df[list(_TABLE_COLUMNS)].dropna(
        axis=1, how="all"
    )  # e.g. no ratios when the baseline did not run
    if "note" in df:
        df["note"] = df["note"].fillna("")
    headings = {c: h for c, (h, _) in _TABLE_COLUMNS.items()}
    formats = {headings[c]: f for c, (_, f) in _TABLE_COLUMNS.items() if f and c in df}
    chosen, fits = comparison["chosen"].to_numpy(), comparison["fits"].to_numpy()

    def row_style(row):
        style = "font-weight: bold; background-color: #eef3fb;" if chosen[row.name] else ""
        return [style + ("" if fits[row.name] else "color: #888;")] * len(row)

    caption = (
        f"Every policy on the same packs; × faster and × fewer bytes are against {baseline}. "
        "Grey rows do not fit in GPU memory or cannot run."
    )
    styler = (
        df.rename(columns=headings)
        .style.format(formats, na_rep="–")
        .apply(row_style, axis=1)
        .hide(axis="index")
        .set_caption(caption)
        .set_table_styles(
            [
                {"selector": "", "props": "max-width: 100%; font-size: 12px;"},
                {
                    "selector": "caption",
                    "props": "caption-side: top; text-align: left; color: #555;",
                },
                {"selector": "th", "props": "text-align: right; white-space: nowrap;"},
            ]
        )
    )
    # numbers stay on one line; the notes wrap, so the table stays within the cell
    numbers = [headings[c] for c in df if c != "note"]
    styler = styler.set_properties(subset=numbers, **{"white-space": "nowrap"})
    if "note" in df:
        styler = styler.set_properties(
            subset=[headings["note"]],
            **{"white-space": "normal", "text-align": "left", "min-width": "24em"},
        )
    return styler


# ---- the real engine next to the simulator ------------------------------------------------
def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


_REAL_COLUMNS = ["executor", "iteration_s", "swap_mb", "peak_mb", "tasks"]


@dataclass
class RealRun:
    """What :meth:`RunForReal.compute` measured and simulated."""

    plan: Plan | None  #: None when the settings give no valid plan
    simulated: (
        Trace | None
    )  #: the simulator on the profiled spec and the emulated device's Hardware
    measured: Trace | None  #: the engine's last step; None when it could not run
    losses: list[float] = field(default_factory=list)  #: one per engine step
    #: one row per executor (simulated, measured): iteration_s, swap_mb, peak_mb, tasks
    comparison: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=_REAL_COLUMNS))
    problem: str | None = None

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict() if self.plan else None,
            "problem": self.problem,
            "losses": self.losses,
            "comparison": _records(self.comparison),
        }

    def table(self):
        """The comparison for reading: units in the headings, rounded."""
        headings = {
            "iteration_s": "s / step",
            "swap_mb": "host↔GPU MB / step",
            "peak_mb": "peak MB on the GPU",
            "tasks": "tasks",
        }
        numbers = {h: "{:.3g}" for c, h in headings.items() if c != "tasks"}
        return self.comparison.rename(columns=headings).style.hide(axis="index").format(numbers)


class RunForReal(_Explorer):
    """A few real training steps of a small zoo GPT-2 with the engine on an
    :class:`~harmony.engine.devices.EmulatedDevice`, next to the simulation of
    the same plan on a spec profiled from the same model.

    ``model`` is a GPT-2 of the zoo (``overrides`` change its configuration,
    e.g. ``{"hidden": 32, "heads": 2}``; dropout is always off so the forward
    and backward microbatches may differ). It runs on one emulated GPU; what
    the engine cannot run becomes the result's ``problem``. ``threads``: torch
    intra-op threads while it runs (one is fastest for toy layers and keeps the
    measurements steady). The widget runs on its button, not on every change.
    """

    def __init__(
        self,
        model: str = "gpt2-tiny",
        overrides: dict | None = None,
        policy: str = "harmony-pp",
        minibatch: int = 8,
        fwd_microbatch: int = 4,
        bwd_microbatch: int = 4,
        pack_size: int = 2,
        offload_activations: bool = False,
        prefetch_packs: int = 2,
        memory: str = "4MB",
        bandwidth: str = "200MB/s",
        steps: int = 2,
        seed: int = 0,
        threads: int | None = 1,
    ):
        config = zoo.MODELS[model].config if model in zoo.MODELS else None
        if not isinstance(config, zoo.GPT2Config):
            gpt2 = sorted(n for n, e in zoo.MODELS.items() if isinstance(e.config, zoo.GPT2Config))
            raise HarmonyError(
                f"RunForReal trains a GPT-2 of the zoo ({', '.join(gpt2)}), not {model!r}"
            )
        self.model_name, self.seed, self.threads = model, seed, threads
        self.overrides = {k: v for k, v in (overrides or {}).items() if k != "n_layer"}
        blocks = (overrides or {}).get("n_layer", config.n_layer)
        self.blocks = w.IntSlider(
            value=blocks,
            min=1,
            max=max(blocks, 12),
            description="GPT-2 blocks",
            continuous_update=False,
            style=_STYLE,
        )
        self.policy = w.Dropdown(options=names(), value=policy, description="policy", style=_STYLE)
        self.minibatch = _int_text(minibatch, "minibatch", 256)
        self.fwd_microbatch = _int_text(fwd_microbatch, "fwd microbatch", 256)
        self.bwd_microbatch = _int_text(bwd_microbatch, "bwd microbatch", 256)
        self.pack_size = w.IntSlider(
            value=pack_size,
            min=1,
            max=max(pack_size, 16),
            description="layers per pack",
            continuous_update=False,
            style=_STYLE,
        )
        self.offload_activations = w.Checkbox(
            value=offload_activations, description="offload activations"
        )
        self.prefetch_packs = w.IntSlider(
            value=prefetch_packs,
            min=1,
            max=3,
            description="prefetch packs",
            continuous_update=False,
            style=_STYLE,
        )
        self.memory = w.Text(value=memory, description="device memory", style=_STYLE)
        self.bandwidth = w.Text(value=bandwidth, description="link (each way)", style=_STYLE)
        self.steps = w.IntSlider(
            value=steps,
            min=1,
            max=max(steps, 10),
            description="engine steps",
            continuous_update=False,
            style=_STYLE,
        )
        self.run_button = w.Button(description="Run for real", button_style="primary", icon="play")
        self.output = w.Output()

    def controls(self) -> list[w.Widget]:
        return [
            self.blocks,
            self.policy,
            self.minibatch,
            self.fwd_microbatch,
            self.bwd_microbatch,
            self.pack_size,
            self.offload_activations,
            self.prefetch_packs,
            self.memory,
            self.bandwidth,
            self.steps,
            self.run_button,
        ]

    def _wire(self) -> None:
        self.run_button.on_click(lambda _: self.render())

    def _model_config(self) -> dict:
        return {**self.overrides, "n_layer": self.blocks.value, "dropout": 0.0}

    def compute(self) -> RealRun:
        """Profile the model, simulate the plan, then train ``steps`` steps with the engine."""
        config = self._model_config()
        B, uf, ub = self.minibatch.value, self.fwd_microbatch.value, self.bwd_microbatch.value
        with torch_threads(self.threads):
            torch.manual_seed(self.seed)
            try:
                layers = zoo.build(self.model_name, device="cpu", **config)[
                    :-1
                ]  # the loss layer is lm_loss
                inputs, target = zoo.example_input(self.model_name, B, **config)
                device = EmulatedDevice(
                    memory=self.memory.value, h2d=self.bandwidth.value, d2h=self.bandwidth.value
                )
                hardware = device.hardware()
                plan = make_plan(
                    self.policy.value,
                    1,
                    B,
                    uf,
                    ub,
                    len(layers),
                    self.pack_size.value,
                    self.offload_activations.value,
                    self.prefetch_packs.value,
                ).validate(len(layers))
            except HarmonyError as err:
                self.result = RealRun(None, None, None, problem=str(err))
                return self.result
            sizes = sorted({*default_sizes(B), uf, ub, B % uf or uf, B % ub or ub})
            spec = profile(
                layers, inputs, target, lm_loss, adamw, sizes=sizes, name=self.model_name
            )
            simulated, sim_problem = play(spec, hardware, plan)
            measured, losses, run_problem = self._train(layers, inputs, target, device, plan)
        problem = run_problem or (f"simulated: {sim_problem}" if sim_problem else None)
        rows = [
            _real_row(name, t)
            for name, t in (("simulated", simulated), ("measured", measured))
            if t is not None
        ]
        self.result = RealRun(
            plan, simulated, measured, losses, pd.DataFrame(rows, columns=_REAL_COLUMNS), problem
        )
        return self.result

    def _train(
        self, layers, inputs, target, device, plan
    ) -> tuple[Trace | None, list[float], str | None]:
        losses = []
        try:
            engine = Engine(
                nn.Sequential(*layers),
                adamw,
                lm_loss,
                device=device,
                minibatch_size=plan.minibatch,
                plan=plan,
                seed=self.seed,
            )
            for _ in range(self.steps.value):
                losses.append(engine.step(inputs, target))
        except HarmonyError as err:
            return None, losses, f"the engine stopped: {err}"
        return engine.trace, losses, None

    def chart(self, result: RealRun | None = None):
        """The simulated and the measured timeline, one over the other on one time axis."""
        alt = _altair()
        r = result or self.result or self.compute()
        parts = [problem_chart(r.problem)] if r.problem else []
        if r.simulated is not None:
            parts.append(
                timeline_chart(
                    r.simulated,
                    title=f"simulated: {r.simulated.iteration_s * 1e3:.1f} ms "
                    f"per step ({r.plan.describe()})",
                    subtitle=plan_notation(r.plan),
                )
            )
        if r.measured is not None:
            # one zoom for both: the time axis is shared
            parts.append(
                timeline_chart(
                    r.measured,
                    title=f"measured: {r.measured.iteration_s * 1e3:.1f} ms, engine "
                    f"step {len(r.losses)} on an emulated GPU",
                    zoom=r.simulated is None,
                )
            )
        return alt.vconcat(*parts).resolve_scale(x="shared")


def _real_row(executor: str, trace: Trace) -> dict:
    s = trace.summary
    return {
        "executor": executor,
        "iteration_s": s.iteration_s,
        "swap_mb": s.swap_bytes / 1e6,
        "peak_mb": max(s.peak_memory.values()) / 1e6,
        "tasks": len(trace.timeline),
    }
