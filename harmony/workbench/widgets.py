"""Interactive explorers for JupyterLab: set a plan with widgets, see what it does.

* :class:`PackExplorer` simulates one plan (pack size, microbatch sizes,
  options) against the paper's baseline, per-layer swapping as vDNN and LMS
  run it (``layer-swap``, on its own plan), and every other policy. A
  faithful baseline chosen by name runs as the system does (its own chooser's
  plan, the headline says so); ``"layer-swap with these packs"`` runs it on the
  controls' packs. Each plan is simulated once (kept per model, server and
  plan), each setting's output is kept (going back shows it at once), and a
  change replaces the output in one step. Its
  headline says whether the paper's claim applies to the setting and why
  (:mod:`.claim`); one click switches between :data:`CASES`, a setting where
  it applies (the default) and one where it does not. Its *host memory* and
  *disk* controls set the server every policy runs on: with less host memory
  than the training state and a disk tier, state goes to disk (the timeline
  shows the disk's lanes, the headline what is on disk); without a disk, a
  message without a chart says which control to change. A preset with fewer
  GPUs lowers the GPUs control, and one with more brings back what the reader
  set (the headline says when there are fewer).
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

import pandas as pd

from ..costs.catalog import SOURCES, known_models
from ..costs.hardware import PRESETS, format_bytes, preset
from ..errors import HarmonyError
from ..plan import Plan
from ..policies import names
from .advice import in_controls_words
from .charts import (
    memory_chart,
    policy_bars,
    problem_chart,
    thin_memory,
    timeline_chart,
)
from .claim import claim_setting, setting
from .comparison import (
    ON_THESE_PACKS,
    baselines,
    default_baseline,
    policy_choices,
    policy_of,
    versus,
)
from .controls import (  # w: ipywidgets, or how to install it
    STYLE,
    PlanExplorer,
    slider,
    w,
)
from .display import live_bundle, live_html, load_altair
from .exploration import Exploration
from .live_spec import chart_texts, exploration_spec
from .play import (
    COLUMNS,
    cached_spec,
    own_plan,
    own_summary,
    played,
    played_summary,
    row,
    server,
)
from .row_pool import Rows, ahead, ahead_on
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
    NVMe disk) sends the optimizer state of 5 of its 20 packs to disk at 90%,
    11 at 75%, 18 at 60%, all and 8 packs' master weights at 45%, and its
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
            policies=policy_choices(),
        )
        #: the GPUs the reader asked for: a preset with fewer lowers the slider, one
        #: with more brings it back
        self._gpus_wanted, self._adjusting = self.n_gpus.value, False
        self.n_gpus.observe(self._gpus_set, "value")
        # wide enough for their labels
        self.cases = [w.Button(description=label, layout={"width": "auto"}) for label in CASES]
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

    def _gpus_set(self, change) -> None:
        if not self._adjusting:
            self._gpus_wanted = change["new"]

    def _hardware_changed(self, _=None) -> None:
        top = preset(self.hardware.value).n_gpus
        with self._held():
            self._adjusting = True
            try:
                self.n_gpus.max = max(top, 1)
                self.n_gpus.value = min(self._gpus_wanted, top)
            finally:
                self._adjusting = False
            self._relabel_host_memory()

    def _model_changed(self, _=None) -> None:
        with self._held(), contextlib.suppress(HarmonyError):  # compute() reports a bad spec
            self.pack_size.max = len(cached_spec(self.model.value, self.source.value))
        self._relabel_host_memory()

    def _wire(self) -> None:
        for control in self.controls():
            control.observe(lambda _: self.render(), "value")
        self.render()

    # ---- compute and draw ------------------------------------------------------------------
    def state(self) -> tuple:
        return (*(c.value for c in self.controls()), self._gpus_wanted)

    def compute(self) -> Exploration:
        """Simulate the chosen plan and one plan per other policy (each plan once:
        :mod:`~harmony.workbench.play` keeps what was played), the other policies'
        side by side in worker processes (:mod:`~harmony.workbench.row_pool`)."""
        baseline, choice = self.baseline.value, self.policy.value
        model, source, hardware = self.model.value, self.source.value, self.hardware.value
        n, minibatch = self.n_gpus.value, self.minibatch.value
        try:
            spec, host, disk, hw = self._server()
        except HarmonyError as err:
            empty = pd.DataFrame(columns=COLUMNS)
            self.result = Exploration(None, None, empty, str(err), baseline, chosen=choice)
            return self.result
        labels = [choice] + [p for p in names() if p != choice]
        policies = {label: policy_of(label) for label in labels}
        on_controls = self._on_controls(policies, len(spec))
        setting_of = {
            label: (policy, model, source, hardware, n, minibatch, host, disk)
            for label, (policy, on_the_controls) in policies.items()
            if not on_the_controls
        }
        # the other rows in the workers (and the claim's resident run), the chosen plan
        # played here meanwhile: its trace is drawn
        others = Rows(
            choosers=[*setting_of.values(), claim_setting(model, source, hardware, minibatch)],
            plays=[(model, source, hw, p) for label, p in on_controls.items() if label != choice],
        )
        if choice in on_controls:
            played(model, source, hw, on_controls[choice])
        others.wait()
        rows = []
        for label in labels:
            if label in on_controls:
                plan, problem = on_controls[label], None
            else:
                plan, problem = own_plan(*setting_of[label])
            trace = summary = None
            if plan and label == choice:
                trace, problem = played(model, source, hw, plan)
                summary = trace.summary if trace is not None else None
            elif plan and label in on_controls:
                summary, problem = played_summary(model, source, hw, plan)
            elif plan:  # a baseline's pick: its chooser simulated it
                summary, problem = own_summary(model, source, hw, plan)
            problem = in_controls_words(problem)
            if label == choice:
                mine = (plan, trace, problem)
            planned_by = "the controls" if label in on_controls else "its own rule"
            rows.append(
                row(label, plan, summary, problem, chosen=label == choice, planned_by=planned_by)
            )
        comparison = versus(pd.DataFrame(rows), baseline)
        said = setting(comparison, choice, model, source, hardware, minibatch, n)
        plan, trace, problem = mine
        tiers = ""
        if host is not None or disk is not None:
            memory = host_memory_words(self.host_memory.value)
            tiers = where_state_lives(spec, hw, plan, trace, memory)
        notes = (self._plan_note(choice, plan), self._gpus_note(hw.n_gpus))
        self.result = Exploration(
            plan, trace, comparison, problem, baseline, said, tiers, choice, notes
        )
        return self.result

    def _server(self) -> tuple:
        """The model's spec, the host memory in bytes (None: the preset's), the disk
        (None: none) and the server of the controls; a HarmonyError says what is
        wrong with them."""
        disk = None if self.disk.value == NO_DISK else self.disk.value
        spec = cached_spec(self.model.value, self.source.value)
        host = host_memory_bytes(self.host_memory.value, spec)
        return spec, host, disk, server(self.hardware.value, host, disk)

    def _on_controls(self, policies: dict, num_layers: int, **sizes: int) -> dict[str, Plan]:
        """The plan on the controls (``sizes`` standing in for some, as
        :meth:`plan_for` takes them) of each of ``policies`` (label: (policy,
        on the controls)) that runs on them."""
        n = self.n_gpus.value
        return {
            label: self.plan_for(policy, n, num_layers, **sizes)
            for label, (policy, on_the_controls) in policies.items()
            if on_the_controls
        }

    def shown(self) -> None:
        """Once an update is shown: the rows of the plans one step from the
        controls' (:meth:`steps`) simulated ahead by the idle workers
        (:func:`~.row_pool.ahead`), every policy's but the chosen one's (the
        explorer plays that one itself: it draws its trace)."""
        if not ahead_on():
            return
        try:
            spec, _, _, hw = self._server()
        except HarmonyError:
            return
        model, source, choice = self.model.value, self.source.value, self.policy.value
        policies = {label: policy_of(label) for label in names() if label != choice}
        plays = []
        for step in self.steps():
            with contextlib.suppress(HarmonyError):  # a size no plan takes: nothing ahead
                plans = self._on_controls(policies, len(spec), **step).values()
                plays += [(model, source, hw, plan) for plan in plans]
        ahead([], plays)

    def _plan_note(self, choice: str, plan) -> str:
        """What the chosen plan is when it is not the controls' alone."""
        policy, on_the_controls = policy_of(choice)
        if not on_the_controls:
            what = f" ({plan.describe()})" if plan else ""
            return (
                f"{policy} as the system runs it: its own chooser's plan{what}, not the "
                f"packs and microbatches of the controls; '{policy}{ON_THESE_PACKS}' runs "
                "it on those"
            )
        if policy != choice:
            return (
                f"{policy} on the packs and microbatches of the controls, not on its own "
                f"chooser's plan (the row '{policy}')"
            )
        return ""

    def _gpus_note(self, has: int) -> str:
        """Why the GPUs are fewer than the reader asked for, if they are."""
        if self.n_gpus.value >= self._gpus_wanted:
            return ""
        return (
            f"On {self.n_gpus.value} GPU{'s' if self.n_gpus.value > 1 else ''}, not "
            f"{self._gpus_wanted}: {self.hardware.value} has {has} (a preset with more "
            "brings the GPUs back)"
        )

    def view(self, result: Exploration) -> list[dict]:
        """The chart and the table; a plan that cannot run gets its message instead of
        a chart (with what to change in the controls) and the table of every policy."""
        if result.trace is None:
            table = result.table().to_html() if len(result.comparison) else ""
            return [live_html(result.message() + table)]
        # the spec built directly: the chart's, without altair's seconds
        return [live_bundle(exploration_spec(result), below=result.table().to_html())]

    def chart(self, result: Exploration | None = None):
        """Headline, problem (if any), swap timeline (with the disk's lanes when
        state is on disk), memory per GPU vs capacity, and iteration time and swap
        volume (host<->GPU bytes) of every policy."""
        alt = load_altair()
        r = result or self.result or self.compute()
        texts = chart_texts(r)
        parts = [problem_chart(r.problem)] if r.problem else []
        if r.trace is not None:
            # one time axis: zooming the timeline zooms the memory too
            parts.append(
                alt.vconcat(
                    timeline_chart(r.trace, title=texts["timeline"], subtitle=texts["notation"]),
                    memory_chart(thin_memory(r.trace)),
                ).resolve_scale(x="shared", color="independent")
            )
        if r.comparison["iteration_s"].notna().any():  # no empty bars
            chosen, swap = r.chosen or None, texts["swap"]
            swap = alt.Title(**swap) if isinstance(swap, dict) else swap
            parts.append(
                alt.hconcat(
                    policy_bars(
                        r.comparison, "iteration_s", texts["time"], "seconds per iteration", chosen
                    ),
                    policy_bars(r.comparison, "swap_gb", swap, "GB per iteration", chosen),
                )
            )
        title = alt.Title(**texts["title"], anchor="start", fontSize=16)
        return alt.vconcat(*parts).resolve_scale(color="independent").properties(title=title)
