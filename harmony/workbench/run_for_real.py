"""The real engine next to the simulator: :class:`RunForReal` trains a small
GPT-2 of the zoo for a few steps with :class:`~harmony.engine.engine.Engine`
on an emulated GPU and simulates the same plan from a profile of the same model.

Needs the ``notebooks`` extra (ipywidgets, altair)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from ..costs import zoo
from ..engine import EmulatedDevice, Engine
from ..engine.profiler import default_sizes, profile
from ..errors import HarmonyError
from ..plan import Plan
from ..trace import Trace
from .charts import plan_notation, problem_chart, timeline_chart
from .controls import (  # w: ipywidgets, or how to install it
    STYLE,
    PlanExplorer,
    html_bundle,
    shown,
    slider,
    w,
)
from .display import load_altair
from .play import play, records
from .training import lm_loss, torch_threads

_COLUMNS = ["executor", "iteration_s", "swap_mb", "peak_mb", "tasks"]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass
class RealRun:
    """What :meth:`RunForReal.compute` measured and simulated."""

    plan: Plan | None  #: None when the settings give no valid plan
    #: the simulator on the profiled spec and the emulated device's Hardware
    simulated: Trace | None
    measured: Trace | None  #: the engine's last step; None when it could not run
    losses: list[float] = field(default_factory=list)  #: one per engine step
    #: one row per executor (simulated, measured): iteration_s, swap_mb, peak_mb, tasks
    comparison: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=_COLUMNS))
    problem: str | None = None

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict() if self.plan else None,
            "problem": self.problem,
            "losses": self.losses,
            "comparison": records(self.comparison),
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


class RunForReal(PlanExplorer):
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
        self.blocks = slider((overrides or {}).get("n_layer", config.n_layer), "GPT-2 blocks", 12)
        self._plan_controls(
            policy,
            minibatch,
            fwd_microbatch,
            bwd_microbatch,
            pack_size,
            offload_activations,
            prefetch_packs,
            top=256,
            most_layers=16,
        )
        self.memory = w.Text(value=memory, description="device memory", style=STYLE)
        self.bandwidth = w.Text(value=bandwidth, description="link (each way)", style=STYLE)
        self.steps = slider(steps, "engine steps", 10)
        self.run_button = w.Button(description="Run for real", button_style="primary", icon="play")
        self.output = w.Output()

    def controls(self) -> list[w.Widget]:
        return [
            self.blocks,
            *self.plan_controls(),
            self.memory,
            self.bandwidth,
            self.steps,
            self.run_button,
        ]

    def _wire(self) -> None:
        self.run_button.on_click(lambda _: self._run())

    def _run(self) -> None:
        """The button: it says what it is doing until the result replaces that."""
        self.run_button.disabled = True
        try:
            self.render()
        finally:
            self.run_button.disabled = False

    def _say(self, doing: str) -> None:
        """Show what the run is doing, in the output, once the widget is shown."""
        if self._box is not None:
            text = html.escape(f"Running for real: {doing}…")
            self.output.outputs = (
                shown(html_bundle(f'<div class="harmony-progress">{text}</div>')),
            )

    def _model_config(self) -> dict:
        return {**self.overrides, "n_layer": self.blocks.value, "dropout": 0.0}

    def compute(self) -> RealRun:
        """Profile the model, simulate the plan, then train ``steps`` steps with the engine."""
        config = self._model_config()
        self._say(f"building {self.model_name} with {config['n_layer']} blocks")
        B, uf, ub = self.minibatch.value, self.fwd_microbatch.value, self.bwd_microbatch.value
        with torch_threads(self.threads):
            torch.manual_seed(self.seed)
            try:
                # the loss layer is lm_loss
                layers = zoo.build(self.model_name, device="cpu", **config)[:-1]
                inputs, target = zoo.example_input(self.model_name, B, **config)
                device = EmulatedDevice(
                    memory=self.memory.value, h2d=self.bandwidth.value, d2h=self.bandwidth.value
                )
                hardware = device.hardware()
                plan = self.plan_for(self.policy.value, 1, len(layers)).validate(len(layers))
            except HarmonyError as err:
                self.result = RealRun(None, None, None, problem=str(err))
                return self.result
            sizes = sorted({*default_sizes(B), uf, ub, B % uf or uf, B % ub or ub})
            self._say(f"profiling its layers at microbatches {', '.join(map(str, sizes))}")
            spec = profile(
                layers, inputs, target, lm_loss, adamw, sizes=sizes, name=self.model_name
            )
            self._say("simulating the plan on the profile")
            simulated, sim_problem = play(spec, hardware, plan)
            measured, losses, run_problem = self._train(layers, inputs, target, device, plan)
        problem = run_problem or (f"simulated: {sim_problem}" if sim_problem else None)
        rows = [
            _row(name, t)
            for name, t in (("simulated", simulated), ("measured", measured))
            if t is not None
        ]
        self.result = RealRun(
            plan, simulated, measured, losses, pd.DataFrame(rows, columns=_COLUMNS), problem
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
            for step in range(self.steps.value):
                self._say(f"training: engine step {step + 1} of {self.steps.value}")
                losses.append(engine.step(inputs, target))
        except HarmonyError as err:
            return None, losses, f"the engine stopped: {err}"
        return engine.trace, losses, None

    def chart(self, result: RealRun | None = None):
        """The simulated and the measured timeline, one over the other on one time axis."""
        alt = load_altair()
        r = result or self.result or self.compute()
        parts = [problem_chart(r.problem)] if r.problem else []
        if r.simulated is not None:
            took = f"{r.simulated.iteration_s * 1e3:.1f} ms per step ({r.plan.describe()})"
            subtitle = plan_notation(r.plan)
            parts.append(timeline_chart(r.simulated, f"simulated: {took}", subtitle=subtitle))
        if r.measured is not None:
            took = f"{r.measured.iteration_s * 1e3:.1f} ms, engine step {len(r.losses)}"
            title = f"measured: {took} on an emulated GPU"
            # one zoom for both: the time axis is shared
            parts.append(timeline_chart(r.measured, title, zoom=r.simulated is None))
        return alt.vconcat(*parts).resolve_scale(x="shared")


def _row(executor: str, trace: Trace) -> dict:
    s = trace.summary
    return {
        "executor": executor,
        "iteration_s": s.iteration_s,
        "swap_mb": s.swap_bytes / 1e6,
        "peak_mb": max(s.peak_memory.values()) / 1e6,
        "tasks": len(trace.timeline),
    }
