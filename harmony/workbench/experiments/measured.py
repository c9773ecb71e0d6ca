"""The measured figures: the engine trains real models on emulated GPUs
(:class:`harmony.EmulatedDevice`), side by side with the plain PyTorch loop,
the simulator or PyTorch's own offload recipe."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pandas as pd

from ...costs.zoo import example_input
from ...engine import EmulatedDevice, EmulatedServer, Engine, reference_step
from ...engine.calibrate import calibrate
from ...engine.profiler import profile
from ...errors import HarmonyError, OutOfMemoryError
from ...plan import Plan
from ...planner import plan_for, simulate
from ..training import build_model, lm_loss, torch_threads
from .settings import ABLATION, BASELINE, BASELINE_STATE


def gpt2_tiny(seed: int = 0, dropout: float = 0.0, **overrides):
    """The zoo's toy GPT-2 as an ``nn.Sequential`` of vLayers without the loss layer."""
    return build_model("gpt2-tiny", seed, dropout=dropout, **overrides)


def synthetic_batches(n: int, minibatch: int, seed: int = 1, **overrides) -> list[tuple]:
    """``n`` random (token ids, targets) minibatches for the toy GPT-2."""
    import torch

    torch.manual_seed(seed)
    return [example_input("gpt2-tiny", minibatch, **overrides) for _ in range(n)]


def adamw(lr: float):
    import torch

    return lambda params: torch.optim.AdamW(params, lr=lr)


@dataclass
class TrainingRun:
    """An engine and a plain loop trained side by side on the same batches."""

    engine: Any
    reference_model: Any
    losses: pd.DataFrame  # step, engine, reference, abs_diff
    microbatch: int
    seconds_engine: float
    seconds_reference: float

    @property
    def max_loss_diff(self) -> float:
        return float(self.losses["abs_diff"].max())

    @property
    def max_weight_diff(self) -> float:
        return max(
            float((a.detach() - b.detach()).abs().max())
            for a, b in zip(self.engine.model.parameters(), self.reference_model.parameters())
        )

    @property
    def bitwise_equal(self) -> bool:
        import torch

        return all(
            torch.equal(a, b)
            for a, b in zip(self.engine.model.parameters(), self.reference_model.parameters())
        )


def train_side_by_side(
    steps: int,
    minibatch: int,
    device,
    plan: Plan | str = "auto",
    microbatch: int | None = None,
    lr: float = 1e-3,
    dropout: float = 0.0,
    n_batches: int = 2,
    seed: int = 0,
    threads: int | None = 1,
    batches: Sequence[tuple] | None = None,
    model: Callable[[], Any] | None = None,
    **model_overrides,
) -> TrainingRun:
    """Train a model for ``steps`` with :class:`harmony.Engine` on ``device``
    under ``plan``, and an identical copy with :func:`harmony.reference_step`
    (the plain PyTorch loop) at the engine's backward microbatch size (or
    ``microbatch``), on the same minibatches in the same order, with
    ``threads`` torch threads. The minibatches are ``batches`` (cycled), else
    ``n_batches`` synthetic ones; the model is a fresh ``model()`` each side,
    else the toy GPT-2 (``seed``, ``dropout``, ``model_overrides``)."""
    data = batches or synthetic_batches(n_batches, minibatch, seed=seed + 1, **model_overrides)
    make = model or (lambda: gpt2_tiny(seed, dropout, **model_overrides))
    steps_data = [data[i % len(data)] for i in range(steps)]
    with torch_threads(threads):
        engine = Engine(
            make(),
            adamw(lr),
            lm_loss,
            device=device,
            minibatch_size=minibatch,
            plan=plan,
            seed=seed,
        )
        t0 = time.perf_counter()
        eng = [engine.step(x, y) for x, y in steps_data]
        t_engine = time.perf_counter() - t0
        u = microbatch or engine.plan.bwd_microbatch
        ref_model = make()
        opt = adamw(lr)(list(ref_model.parameters()))
        t0 = time.perf_counter()
        ref = [
            reference_step(list(ref_model), lm_loss, opt, x, y, u, step, seed=seed)
            for step, (x, y) in enumerate(steps_data)
        ]
        t_ref = time.perf_counter() - t0
    losses = pd.DataFrame({"step": range(steps), "engine": eng, "reference": ref})
    losses["abs_diff"] = (losses["engine"] - losses["reference"]).abs()
    return TrainingRun(engine, ref_model, losses, u, t_engine, t_ref)


def activation_bytes(spec, minibatch: int) -> float:
    """Bytes autograd saves for a whole minibatch run at once (from a measured profile)."""
    return float(sum(c.bwd_extra(minibatch) for c in spec.layers))


def training_footprint(model, activations: float = 0.0) -> float:
    """Bytes of weights, gradients and AdamW's two states, plus ``activations``."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * params + activations


def exactness_variants(
    steps: int,
    minibatch: int,
    microbatch: int,
    layers_per_pack: int,
    dropout: float,
    memory: str,
    bandwidth: str,
    lr: float,
    seed: int,
    multi_gpu: int = 2,
    threads: int | None = 1,
) -> tuple[pd.DataFrame, dict[str, TrainingRun]]:
    """Train the toy GPT-2 with the engine under several plans and with the
    plain loop, and compare. One row per variant: what it is, what is
    expected, max |loss difference|, max |weight difference|, bitwise equal.
    A variant the engine refuses gets a row that says why (``status``)."""
    n_layers = len(gpt2_tiny(seed))
    one = EmulatedDevice(memory=memory, h2d=bandwidth, d2h=bandwidth)
    many = EmulatedServer(gpus=multi_gpu, memory=memory, h2d=bandwidth, d2h=bandwidth)
    variants = _exactness_plans(
        minibatch, microbatch, n_layers, layers_per_pack, dropout, multi_gpu, one, many
    )
    rows, runs = [], {}
    for name, expected, p, device, chosen in variants:
        row = {"variant": name, "plan": chosen.describe(), "dropout": p, "expected": expected}
        try:
            run = train_side_by_side(
                steps,
                minibatch,
                device,
                plan=chosen,
                microbatch=microbatch,
                lr=lr,
                dropout=p,
                seed=seed,
                threads=threads,
            )
        except (HarmonyError, NotImplementedError, TypeError, ValueError) as e:
            rows.append({**row, "status": f"not run: {type(e).__name__}: {e}"})
            continue
        runs[name] = run
        rows.append(
            {
                **row,
                "status": "ran",
                "max_loss_diff": run.max_loss_diff,
                "max_weight_diff": run.max_weight_diff,
                "bitwise_equal": run.bitwise_equal,
                "engine_s": run.seconds_engine,
                "reference_s": run.seconds_reference,
            }
        )
    return pd.DataFrame(rows), runs


def _exactness_plans(
    minibatch: int,
    microbatch: int,
    n_layers: int,
    layers_per_pack: int,
    dropout: float,
    multi_gpu: int,
    one: EmulatedDevice,
    many: EmulatedServer,
) -> list[tuple[str, str, float, object, Plan]]:
    """:func:`exactness_variants`' variants: (name, what is expected, dropout, device,
    plan)."""

    def plan(
        policy: str = "harmony-pp", n_gpus: int = 1, fwd_microbatch: int | None = None
    ) -> Plan:
        return Plan.uniform(
            policy,
            n_gpus,
            minibatch,
            microbatch,
            n_layers,
            layers_per_pack,
            fwd_microbatch=fwd_microbatch,
        )

    return [
        ("harmony-pp x1, uF = uB", "bitwise", dropout, one, plan()),
        (f"{BASELINE} x1", "bitwise", dropout, one, plan(BASELINE).with_options(**BASELINE_STATE)),
        (
            "harmony-pp x1, uF = 2 uB (no dropout)",
            "allclose (forward batched differently)",
            0.0,
            one,
            plan(fwd_microbatch=min(2 * microbatch, minibatch)),
        ),
        (f"harmony-pp x{multi_gpu}", "bitwise", dropout, many, plan("harmony-pp", multi_gpu)),
        (
            f"harmony-dp x{multi_gpu}",
            "allclose (gradients summed across GPUs)",
            dropout,
            many,
            plan("harmony-dp", multi_gpu),
        ),
    ]


def baseline_comparison(
    engine, device, batch: tuple, run_engine: bool = True, threads: int | None = 1
) -> pd.DataFrame:
    """Bytes over the emulated link per step: the engine's Harmony plan (as
    measured and as simulated on the engine's measured profile) against
    :data:`BASELINE` as its own chooser plans it for the same device
    (simulated and, with ``run_engine``, its second step in a fresh engine).
    Where the baseline has no plan that fits the device, its row says why
    (``status``)."""
    hw = device.hardware()
    spec = engine.profile or engine.spec
    try:
        base, why = plan_for(BASELINE, spec, hw, engine.minibatch_size), ""
    except OutOfMemoryError as e:
        base, why = None, f"does not fit: {e}"
    rows = []
    for policy, plan in (("harmony-pp", engine.plan), (BASELINE, base)):
        if plan is None:
            rows.append({"policy": policy, "how": "simulated", "status": why})
            continue
        sim = simulate(spec, hw, plan).summary
        rows.append(
            {
                "policy": policy,
                "plan": plan.describe(),
                "how": "simulated",
                "status": "fits" if sim.fits else "does not fit (simulated)",
                "swap_mb": sim.swap_bytes / 1e6,
                "iteration_s": sim.iteration_s,
                "peak_mb": max(sim.peak_memory.values()) / 1e6,
            }
        )
    runs = [("harmony-pp", engine.plan, engine.trace.summary)]
    if run_engine and base is not None:
        other = Engine(
            gpt2_tiny(engine.seed),
            adamw(1e-3),
            engine.loss_fn,
            device=device,
            minibatch_size=engine.minibatch_size,
            plan=base,
            seed=engine.seed,
        )
        x, y = batch
        with torch_threads(threads):
            # the second step is counted: AdamW creates its state in its first, so only
            # from then on does an optimizer step on the GPU bring the state in
            for _ in range(2):
                other.step(x, y)
        runs.append((BASELINE, base, other.trace.summary))
    for policy, plan, s in runs:
        rows.append(
            {
                "policy": policy,
                "plan": plan.describe(),
                "how": "measured (engine)",
                "status": "ran",
                "swap_mb": s.swap_bytes / 1e6,
                "iteration_s": s.iteration_s,
                "peak_mb": max(s.peak_memory.values()) / 1e6,
            }
        )
    return pd.DataFrame(rows)


def median_step_s(engine, inputs: tuple, target, steps: int) -> float:
    """Median wall time of ``steps`` engine steps after a warm-up step."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        engine.step(inputs, target)
        times.append(time.perf_counter() - t0)
    return float(pd.Series(times[1:]).median())


def emulated_throughput(
    gpus: int = 2,
    minibatch: int = 16,
    microbatch: int = 2,
    layers_per_pack: int = 1,
    steps: int = 2,
    memory: str = "4MB",
    bandwidth: str = "20MB/s",
    seed: int = 0,
    threads: int | None = 1,
    **model_overrides,
) -> pd.DataFrame:
    """Samples/s of the toy GPT-2 measured by the engine on an emulated server
    of ``gpus`` GPUs (per-GPU links of ``bandwidth``, one uplink as fast as two
    of them), median step after a warm-up, at one microbatch size for all:
    Harmony-PP and Harmony-DP on packs of ``layers_per_pack`` layers,
    :data:`BASELINE` as vDNN / LMS run it (one layer per pack, the next layer
    prefetched, gradient sums and the optimizer on the GPU, data parallel) and
    the :data:`ABLATION` on Harmony's packs. ``speedup_vs_baseline``: samples/s
    over the baseline's."""
    server = EmulatedServer(gpus=gpus, memory=memory, h2d=bandwidth, d2h=bandwidth, p2p=bandwidth)
    rows = []
    with torch_threads(threads):
        n = len(gpt2_tiny(seed, **model_overrides))
        (x,), y = synthetic_batches(1, minibatch, seed=seed + 1, **model_overrides)[0]
        runs = [
            (p, Plan.uniform(p, gpus, minibatch, microbatch, n, layers_per_pack))
            for p in ("harmony-pp", "harmony-dp")
        ]
        faithful = Plan.uniform(BASELINE, gpus, minibatch, microbatch, n, 1, **BASELINE_STATE)
        runs.append((BASELINE, faithful))
        ablation = Plan.uniform(ABLATION, gpus, minibatch, microbatch, n, layers_per_pack)
        runs.append((f"{ABLATION} (ablation)", ablation))
        for label, plan in runs:
            engine = Engine(
                gpt2_tiny(seed, **model_overrides),
                adamw(1e-3),
                lm_loss,
                device=server,
                minibatch_size=minibatch,
                plan=plan,
                seed=seed,
            )
            row = {
                "policy": plan.policy,
                "label": label,
                "gpus": gpus,
                "plan": plan.describe(),
                "microbatch": plan.bwd_microbatch,
            }
            try:
                step_s = median_step_s(engine, (x,), y, steps)
            except OutOfMemoryError as e:  # the emulated GPUs' ledgers enforce their memory
                rows.append({**row, "fits": False, "reason": str(e)})
                continue
            rows.append(
                {
                    **row,
                    "fits": True,
                    "reason": "ran",
                    "step_s": step_s,
                    "samples_per_s": minibatch / step_s,
                    "swap_mb": engine.trace.summary.swap_bytes / 1e6,
                }
            )
    df = pd.DataFrame(rows)
    base = df.loc[(df.policy == BASELINE) & df.fits, "samples_per_s"] if "step_s" in df else []
    df["speedup_vs_baseline"] = df.get("samples_per_s", math.nan) / (
        base.iloc[0] if len(base) else math.nan
    )
    return df


def fidelity_grid(
    pack_sizes: Sequence[int],
    microbatches: Sequence[int],
    minibatch: int = 16,
    steps: int = 3,
    memory: str = "8MB",
    bandwidth: str = "50MB/s",
    seed: int = 0,
    threads: int | None = 1,
    **model_overrides,
) -> pd.DataFrame:
    """Simulated vs measured iteration time and peak device memory of harmony-pp
    plans (layers per backward pack x microbatch size) for the toy GPT-2 on an
    emulated GPU. The simulator plays the plan on the model's profile measured
    here and the engine's cost per task measured on the same device; the engine
    runs it (median over ``steps`` after a warm-up step)."""
    device = EmulatedDevice(memory=memory, h2d=bandwidth, d2h=bandwidth)
    with torch_threads(threads):
        hw = calibrate(device)
        model = gpt2_tiny(seed, **model_overrides)
        (x,), y = synthetic_batches(1, minibatch, seed=seed + 1, **model_overrides)[0]
        spec = profile(list(model), (x,), y, lm_loss, adamw(1e-3), name="gpt2-tiny")
        rows = []
        for size in pack_sizes:
            for u in microbatches:
                if u > minibatch:
                    continue
                plan = Plan.uniform("harmony-pp", 1, minibatch, u, len(spec), size)
                sim = simulate(spec, hw, plan).summary
                row = {
                    "layers_per_pack": size,
                    "microbatch": u,
                    "plan": plan.describe(),
                    "simulated_s": sim.iteration_s,
                    "simulated_peak_mb": sim.peak_memory["gpu0"] / 1e6,
                }
                if not sim.fits:
                    rows.append({**row, "status": "over memory (simulated)"})
                    continue
                engine = Engine(
                    gpt2_tiny(seed, **model_overrides),
                    adamw(1e-3),
                    lm_loss,
                    device=device,
                    minibatch_size=minibatch,
                    plan=plan,
                    seed=seed,
                    spec=spec,
                )
                rows.append(
                    {
                        **row,
                        "status": "ran",
                        "measured_s": median_step_s(engine, (x,), y, steps),
                        "measured_peak_mb": engine.trace.summary.peak_memory["gpu0"] / 1e6,
                    }
                )
    df = pd.DataFrame(rows)
    if "measured_s" in df:
        df["time_ratio"] = df["measured_s"] / df["simulated_s"]
        df["peak_ratio"] = df["measured_peak_mb"] / df["simulated_peak_mb"]
    return df
