"""Interactive explorers for JupyterLab: set a plan with widgets, see what it does.

* :class:`PackExplorer` simulates one plan (pack size, microbatch sizes,
  options) against the paper's baseline, per-layer swapping as vDNN and LMS
  run it (``layer-swap``, on its own plan), and every other policy. Its
  headline says whether the paper's claim applies to the setting and why
  (:mod:`.claim`); one click switches between :data:`CASES`, a setting where
  it applies (the default) and one where it does not. Its *host memory* and
  *disk* controls set the server every policy runs on: with less host memory
  than the training state and a disk tier, state goes to disk (the timeline
  shows the disk's lanes, the headline what is on disk); without a disk, the
  planner says what to set.
* :class:`RunForReal` (:mod:`.run_for_real`) trains a small GPT-2 of the zoo
  for a few steps with the real engine on an emulated GPU and simulates the
  same plan from a profile of the same model.

Both hold their controls as ipywidgets attributes (set ``.value`` from code
too, or several at once with ``set``); ``compute()`` reads them and returns a
result, ``chart()`` draws it with altair and ``widget()`` lays the controls out
over an output that shows the chart and a table. Infeasible settings never
raise: the result's ``problem`` says in words what is wrong, and the chart
shows what can be shown.

The policies offered, and the baselines compared against, are those of
:mod:`harmony.policies` (a policy added there shows up here by itself).

Needs the ``notebooks`` extra (ipywidgets, altair, vl-convert).
"""

from __future__ import annotations

import contextlib
import textwrap
from dataclasses import dataclass

import pandas as pd

from ..costs.catalog import SOURCES, known_models
from ..costs.hardware import PRESETS, format_bytes, preset
from ..errors import HarmonyError
from ..plan import Plan
from ..planner.systems import PLAN_MAKERS
from ..policies import names
from ..trace import Trace
from .charts import (
    memory_chart,
    plan_notation,
    policy_bars,
    problem_chart,
    thin_memory,
    timeline_chart,
)
from .claim import setting
from .comparison import baselines, comparison_table, default_baseline, headline, versus
from .controls import STYLE, PlanExplorer, slider, w  # w: ipywidgets, or how to install it
from .display import load_altair
from .play import COLUMNS, cached_spec, own_plan, play, records, row, server
from .run_for_real import RealRun, RunForReal
from .tiers import (
    AS_PRESET,
    DISK_CHOICES,
    HOST_SHARES,
    NO_DISK,
    host_memory_bytes,
    host_memory_words,
    training_state,
    where_state_lives,
)

__all__ = [
    "AS_PRESET",
    "CASES",
    "CLAIM_APPLIES",
    "CLAIM_DOES_NOT_APPLY",
    "DISK_CHOICES",
    "Exploration",
    "HOST_SHARES",
    "NO_DISK",
    "PackExplorer",
    "RealRun",
    "RunForReal",
    "training_state",
]

#: the explorer's default: the paper's setting, a model larger than a GPU
#: (BERT-96: 20 GB of weights, gradients and Adam state) on the paper's 4-GPU server
CLAIM_APPLIES = {
    "model": "bert-96",
    "hardware": "paper-4x1080ti",
    "n_gpus": 4,
    "minibatch": 32,
    "fwd_microbatch": 4,
    "bwd_microbatch": 8,
    "pack_size": 2,
}
#: one click away, a model that fits in one GPU (BERT-Large: 5.4 GB) trained on one
CLAIM_DOES_NOT_APPLY = {**CLAIM_APPLIES, "model": "bert-large", "n_gpus": 1, "minibatch": 8}
#: button label -> the controls it sets
CASES = {
    "where the paper's claim applies": CLAIM_APPLIES,
    "where it does not": CLAIM_DOES_NOT_APPLY,
}


@dataclass
class Exploration:
    """What :meth:`PackExplorer.compute` found."""

    plan: Plan | None  #: None when the model's spec could not be loaded
    trace: Trace | None  #: None when the plan is invalid or too large to simulate
    #: one row per policy: policy, chosen, planned_by ("the controls", or a
    #: baseline's "own rule"), fwd/bwd microbatch, iteration_s, samples_per_s,
    #: swap_gb (host<->GPU), disk_gb (host<->disk), peak_gb, fits, status ("fits",
    #: "does not fit: ...", "not run:
    #: ..."), note (why a row could not be simulated or fit),
    #: speedup_vs_baseline (the baseline's time / this one's),
    #: swap_ratio_vs_baseline (the baseline's swap volume / this one's)
    comparison: pd.DataFrame
    problem: str | None  #: why the chosen plan cannot run, in words
    baseline: str = ""  #: the policy the ratios compare against
    #: whether the paper's claim applies here, and why (:func:`.claim.setting`)
    setting: str = ""
    #: with the host memory or the disk not the preset's: the server's, and what of the
    #: chosen plan's training state is on disk (:func:`where_state_lives`)
    tiers: str = ""

    @property
    def headlines(self) -> list[str]:
        """The chosen plan's time and swap volume against the baseline's (and
        the fastest policy that fits, when that is another), where its training
        state lives (when the host memory or the disk is set), then the setting."""
        if self.plan is None:
            return [f"nothing to simulate: {self.problem}"]
        numbers = headline(self.comparison, self.plan.policy, self.baseline)
        return [line for line in (numbers, self.tiers, self.setting) if line]

    @property
    def headline(self) -> str:
        """:attr:`headlines` as one text."""
        return ". ".join(self.headlines)

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
            "setting": self.setting,
            "tiers": self.tiers,
            "iteration_s": s and s.iteration_s,
            "swap_bytes": s and s.swap_bytes,
            "disk_bytes": s and s.disk_bytes,
            "peak_memory": s and s.peak_memory,
            "comparison": records(self.comparison),
        }


class PackExplorer(PlanExplorer):
    """Pack size and microbatch sizes of one plan, simulated against every
    other policy of :mod:`harmony.policies` on the same GPU count: the faithful
    baselines (:data:`~harmony.planner.systems.PLAN_MAKERS`: per-layer
    swapping, GPipe with swapping, model parallelism) on the plan their own
    rule picks, as those systems would run; the others on the controls' packs
    (a policy that runs each microbatch forward then backward uses the
    backward microbatch for both). ``baseline`` (default
    :func:`~harmony.workbench.comparison.default_baseline`) is the one the
    headline and the ratios compare to. The defaults are
    :data:`CLAIM_APPLIES`.

    ``host_memory`` and ``disk`` set the server every policy runs on (all the
    rows, so the ratios compare systems on one server). ``host_memory``: None
    (:data:`AS_PRESET`, the preset's own: hundreds of GB, so nothing goes to
    disk), a share of the model's training state (:data:`HOST_SHARES`; master
    weights, gradients and optimizer state, :func:`training_state`) or a size
    (``"24GiB"``, bytes). The control offers shares rather than fixed sizes, so
    that every model of the zoo, from BERT-Large's 5.4 GB of state to
    GPT-2 10B's 168 GB, has state to move: with Adam half the state is
    optimizer state and a quarter gradients, which never go to disk. Harmony's
    policies then hold only two packs' gradients (slots), the ablations every
    pack's: on GPT-2 XL at minibatch 32, the planner's harmony-pp plan (with an
    NVMe disk) sends the optimizer state of 6 of its 20 packs to disk at 90%,
    12 at 75%, 18 at 60%, all and 10 packs' master weights at 45%, and its
    stashes too at 30%; harmony-no-grouping's gradients, stashes and staging
    fit at 50% only with its stashes on disk, and not at all at 30%. How low a
    plan goes depends on its stashes and packs: below, the planner says so.
    ``disk``: None (:data:`NO_DISK`: no disk tier, so the state must fit host
    memory; the planner's message says what to set otherwise), a name of
    :data:`~harmony.costs.hardware.DISKS` (``"nvme"``) or ``"<read>,<write>"``
    (``"0.5GB/s,0.5GB/s,shared"``: a SATA SSD, whose reads and writes take turns;
    :data:`DISK_CHOICES`). A size or a disk
    not offered is added to its control's choices (by ``set`` too). With state
    on disk the timeline shows the disk's lanes (``host.disk_read``,
    ``host.disk_write``), the table its bytes (``disk GB``: swap GB counts
    host<->GPU bytes only) and the headline what is on disk.

    The widget re-draws on every change; plans over
    :data:`~harmony.workbench.play.MAX_TASKS` tasks are not simulated
    (``problem`` says so)."""

    def __init__(
        self,
        model: str = CLAIM_APPLIES["model"],
        source: str = "auto",
        hardware: str = CLAIM_APPLIES["hardware"],
        policy: str = "harmony-pp",
        n_gpus: int | None = None,
        minibatch: int = CLAIM_APPLIES["minibatch"],
        fwd_microbatch: int = CLAIM_APPLIES["fwd_microbatch"],
        bwd_microbatch: int = CLAIM_APPLIES["bwd_microbatch"],
        pack_size: int = CLAIM_APPLIES["pack_size"],
        offload_activations: bool = False,
        prefetch_packs: int = 2,
        baseline: str | None = None,
        host_memory: str | int | None = None,
        disk: str | None = None,
    ):
        gpus = preset(hardware).n_gpus
        self.model = w.Dropdown(
            options=known_models(), value=model, description="model", style=STYLE
        )
        self.source = w.Dropdown(
            options=SOURCES, value=source, description="spec source", style=STYLE
        )
        self.hardware = w.Dropdown(
            options=list(PRESETS), value=hardware, description="hardware", style=STYLE
        )
        self.baseline = w.Dropdown(
            options=baselines(),
            value=baseline or default_baseline(),
            description="compared with",
            style=STYLE,
        )
        self.n_gpus = slider(n_gpus or gpus, "GPUs", gpus)
        self._host_choices: list[str | int] = [AS_PRESET, *HOST_SHARES]
        self.host_memory = w.Dropdown(description="host memory", style=STYLE)
        self.disk = w.Dropdown(options=list(DISK_CHOICES.items()), description="disk", style=STYLE)
        self._offer(host_memory=host_memory, disk=disk)
        self._plan_controls(
            policy,
            minibatch,
            fwd_microbatch,
            bwd_microbatch,
            pack_size,
            offload_activations,
            prefetch_packs,
            top=4096,
            most_layers=64,
        )
        self.cases = [w.Button(description=label) for label in CASES]
        for button in self.cases:
            button.on_click(lambda b: self.set(**CASES[b.description]))
        self.output = w.Output()
        self.hardware.observe(self._hardware_changed, "value")
        self.model.observe(self._model_changed, "value")
        self.source.observe(self._model_changed, "value")
        self._model_changed()

    def controls(self) -> list[w.Widget]:
        policy, *plan = self.plan_controls()
        server = [self.hardware, self.host_memory, self.disk]
        return [self.model, self.source, *server, policy, self.baseline, self.n_gpus, *plan]

    def actions(self) -> list[w.Widget]:
        return self.cases

    def set(self, **values) -> None:
        """As :meth:`Explorer.set`; ``host_memory`` and ``disk`` take what the
        constructor does (None, a size or a disk not offered yet)."""
        with self._held():
            values.update(
                self._offer(**{k: values[k] for k in ("host_memory", "disk") if k in values})
            )
        super().set(**values)

    # keep the controls consistent with each other
    def _offer(self, **choices) -> dict:
        """Add the ``host_memory`` and ``disk`` given (None: the default) to their
        controls' choices where they are not there yet, select them, and return
        them as the controls' values."""
        out = {}
        if "host_memory" in choices:
            value = AS_PRESET if choices["host_memory"] is None else choices["host_memory"]
            if value not in self._host_choices:
                self._host_choices.append(value)
            self._relabel_host_memory(value)
            out["host_memory"] = value
        if "disk" in choices:
            value = NO_DISK if choices["disk"] is None else choices["disk"]
            if value not in [v for _, v in self.disk.options]:
                with self._held():
                    self.disk.options = [*self.disk.options, (str(value), value)]
            out["disk"] = self.disk.value = value
        return out

    def _host_label(self, choice: str | int) -> str:
        """A host memory choice in words, with its size for this model and preset."""
        if choice == AS_PRESET:
            return f"{AS_PRESET} ({format_bytes(preset(self.hardware.value).host_memory)})"
        try:
            size = host_memory_bytes(choice, cached_spec(self.model.value, self.source.value))
        except HarmonyError:  # compute() says what is wrong
            return str(choice)
        if host_memory_words(choice):
            return f"{host_memory_words(choice)} ({format_bytes(size)})"
        return (
            f"{choice} ({format_bytes(size)})" if isinstance(choice, str) else format_bytes(size)
        )

    def _relabel_host_memory(self, value=None) -> None:
        """The host memory choices labelled with their sizes for the model and
        preset now; ``value`` (default: the one selected) selected."""
        value = self.host_memory.value if value is None else value
        with self._held():  # a change of options deselects: no drawing until it is back
            self.host_memory.options = [(self._host_label(c), c) for c in self._host_choices]
            self.host_memory.value = value

    def _hardware_changed(self, _=None) -> None:
        self.n_gpus.max = preset(self.hardware.value).n_gpus
        self._relabel_host_memory()

    def _model_changed(self, _=None) -> None:
        with contextlib.suppress(HarmonyError):  # an unknown spec is reported by compute()
            self.pack_size.max = len(cached_spec(self.model.value, self.source.value))
        self._relabel_host_memory()

    def _wire(self) -> None:
        for control in self.controls():
            control.observe(lambda _: self.render(), "value")
        self.render()

    # ---- compute and draw ------------------------------------------------------------------
    def compute(self) -> Exploration:
        """Simulate the chosen plan and one plan per other policy."""
        baseline, chosen = self.baseline.value, self.policy.value
        model, source, hardware = self.model.value, self.source.value, self.hardware.value
        n, minibatch = self.n_gpus.value, self.minibatch.value
        disk = None if self.disk.value == NO_DISK else self.disk.value
        try:
            spec = cached_spec(model, source)
            host = host_memory_bytes(self.host_memory.value, spec)
            hw = server(hardware, host, disk)
        except HarmonyError as err:
            empty = pd.DataFrame(columns=COLUMNS)
            self.result = Exploration(None, None, empty, str(err), baseline)
            return self.result
        rows = []
        for policy in [chosen] + [p for p in names() if p != chosen]:
            if policy != chosen and policy in PLAN_MAKERS:
                plan, problem = own_plan(policy, model, source, hardware, n, minibatch, host, disk)
                trace, problem = play(spec, hw, plan) if plan else (None, problem)
                planned_by = "its own rule"
            else:
                plan = self.plan_for(policy, n, len(spec))
                trace, problem = play(spec, hw, plan)
                planned_by = "the controls"
            if policy == chosen:
                mine = (plan, trace, problem)
            rows.append(
                row(policy, plan, trace, problem, chosen=policy == chosen, planned_by=planned_by)
            )
        comparison = versus(pd.DataFrame(rows), baseline)
        said = setting(comparison, chosen, model, source, hardware, minibatch, n)
        plan, trace, problem = mine
        tiers = ""
        if host is not None or disk is not None:
            memory = host_memory_words(self.host_memory.value)
            tiers = where_state_lives(spec, hw, plan, trace, memory)
        self.result = Exploration(plan, trace, comparison, problem, baseline, said, tiers)
        return self.result

    def chart(self, result: Exploration | None = None):
        """Headline, problem (if any), swap timeline (with the disk's lanes when
        state is on disk), memory per GPU vs capacity, and iteration time and swap
        volume (host<->GPU bytes) of every policy."""
        alt = load_altair()
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
        if len(r.comparison):
            chosen = r.plan.policy if r.plan else None
            time = "time per iteration (shorter is faster)"
            swap = "bytes over host↔GPU links per iteration"
            if (r.comparison["disk_gb"] > 0).any():  # counted apart, in the table
                swap = alt.Title(swap, subtitle="not the disk's: disk GB in the table")
            parts.append(
                alt.hconcat(
                    policy_bars(
                        r.comparison, "iteration_s", time, "seconds per iteration", chosen
                    ),
                    policy_bars(r.comparison, "swap_gb", swap, "GB per iteration", chosen),
                )
            )
        own = ", ".join(PLAN_MAKERS)
        subtitle = (
            f"ratios against {r.baseline}; {own} on their own plans, the others on these controls"
        )
        # vega does not wrap titles: lines about as wide as the charts
        lines = [part for line in r.headlines for part in textwrap.wrap(line, 110)]
        title = alt.Title(lines, subtitle=subtitle, anchor="start", fontSize=16)
        return alt.vconcat(*parts).resolve_scale(color="independent").properties(title=title)
