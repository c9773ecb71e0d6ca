"""What the notebooks compute: one function per figure of the Harmony paper
(VLDB 2022), returning tables; charts of those tables; writing results.

The notebooks in ``notebooks/`` are thin glue over this module: a parameters
cell, calls to these functions, :func:`write_outputs`. Everything here is
plain Python, importable and testable without Jupyter.

Simulated experiments use the GTX 1080 Ti per-layer profiles measured by the
Harmony authors (:func:`harmony.model_spec`) on the paper's server presets
(``paper-4x1080ti``; ``paper-8x1080ti`` for 8 GPUs). Real runs use
:class:`harmony.Engine` on an :class:`harmony.EmulatedDevice`.

Defaults for each notebook's ``quick`` and ``full`` modes are in
:data:`DEFAULTS`; :func:`settings` fills a notebook's unset parameters from them.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from .baselines import TorchOffload, fastest_microbatch, timed
from ..costs.catalog import model_spec
from ..engine import EmulatedDevice, Engine
from ..engine.calibrate import calibrate
from ..engine.profiler import default_sizes, link_like_1080ti, profile
from ..errors import HarmonyError, OutOfMemoryError
from ..costs.hardware import Hardware, parse_rate, preset
from ..planner.multi_model import Job, compare_schedules, simulate_many
from ..trace import Summary
from ..engine.optim import FlatAdamW
from ..plan import Pack, Plan
from ..policies import names
from ..planner import plans_for, search
from ..planner import simulate
from .training import build_model, lm_loss, torch_threads
from .charts import bar_chart, save
from ..costs.zoo import example_input

HARDWARE = "paper-4x1080ti"
HARDWARE_8 = "paper-8x1080ti"
HARMONY_POLICIES = tuple(names("harmony"))
BASELINE = "virtual-memory"
PAPER_MODELS = ["bert-96", "gpt2-xl", "vgg416", "resnet1026"]

#: each notebook's parameters in quick mode (CPU, seconds) and full mode (the paper's set)
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "10_swap_volume": {
        "quick": {"models": ["gpt2-xl"], "minibatches": [16, 64]},
        "full": {"models": ["gpt2-xl", "bert-96", "vgg416", "resnet1026"], "minibatches": [16, 64, 256]},
    },
    "11_throughput": {
        "quick": {"models": ["gpt2-xl", "bert-96"], "minibatches": [64]},
        "full": {"models": PAPER_MODELS, "minibatches": [16, 64, 256]},
    },
    "12_pack_vs_microbatch": {
        "quick": {"minibatch": 64, "pack_sizes": [1, 2, 4, 7, 14], "microbatches": [1, 2, 4, 8, 16, 32, 64]},
        "full": {"minibatch": 600, "pack_sizes": [1, 2, 3, 4, 6, 7, 10, 14, 28],
                 "microbatches": [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 78]},
    },
    "13_planner_table": {
        "quick": {"models": ["gpt2-xl", "bert-96"]},
        "full": {"models": PAPER_MODELS},
    },
    "14_scaling": {
        "quick": {"models": ["gpt2-10b"], "gpu_counts": [1, 2, 4], "minibatch": 8},
        "full": {"models": ["gpt2-10b", "gpt2-20b", "gpt2-30b", "gpt2-40b"], "gpu_counts": [1, 2, 4, 8],
                 "minibatch": 32},
    },
    "15_exact_match": {
        "quick": {"steps": 4},
        "full": {"steps": 20},
    },
    "00_quickstart": {
        "quick": {"steps": 6},
        "full": {"steps": 20},
    },
    "17_systems": {
        "quick": {"models": ["gpt2-xl"], "minibatches": [16], "depths": [12, 24, 36, 48]},
        "full": {"models": ["gpt2-xl", "bert-96"], "minibatches": [16, 64, 256], "depths": list(range(6, 49, 6))},
    },
    "18_vs_torch": {
        "quick": {"hidden": 128, "blocks": 4, "minibatch": 16, "memory": "12MB", "steps": 3},
        "full": {"hidden": 256, "blocks": 6, "minibatch": 32, "memory": "56MB", "steps": 5},
    },
    "16_simulator_fidelity": {
        "quick": {"steps": 3, "pack_sizes": [1, 3], "microbatches": [2, 8]},
        "full": {"steps": 6, "pack_sizes": [1, 2, 3, 6], "microbatches": [1, 2, 4, 8, 16]},
    },
}


def settings(experiment: str, quick: bool, **given: Any) -> dict[str, Any]:
    """The parameters of ``experiment``: each one ``given`` that is not None,
    else its default for the mode (``quick`` or full)."""
    if experiment not in DEFAULTS:
        raise HarmonyError(f"unknown experiment {experiment!r}; known: {', '.join(DEFAULTS)}")
    defaults = DEFAULTS[experiment]["quick" if quick else "full"]
    out = dict(defaults)
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def hardware_for(n_gpus: int, hardware: str = HARDWARE) -> Hardware:
    """The paper's 4-GPU server for up to 4 GPUs, its 8-GPU configuration beyond."""
    hw = preset(hardware)
    if n_gpus > hw.n_gpus and hardware == HARDWARE:
        hw = preset(HARDWARE_8)
    if n_gpus > hw.n_gpus:
        raise HarmonyError(f"{hw.name} has {hw.n_gpus} GPUs, {n_gpus} asked")
    return hw


# ---- searching ------------------------------------------------------------------
@dataclass
class Best:
    """The fastest plan of each policy for one model and minibatch, from one search."""

    model: str
    minibatch: int
    per_policy: dict[str, pd.Series]
    search_s: float
    simulated: int
    table: pd.DataFrame = field(repr=False)

    def fastest(self, policies: Iterable[str]) -> pd.Series | None:
        rows = [self.per_policy[p] for p in policies if p in self.per_policy]
        return min(rows, key=lambda r: r["iteration_s"]) if rows else None


def best_plans(model: str, minibatch: int, hardware: str = HARDWARE,
               policies: Sequence[str] = (*HARMONY_POLICIES, BASELINE), n_gpus: int | None = None,
               workers: int | None = None) -> Best:
    """Search ``model`` at ``minibatch`` and keep the fastest plan of each policy
    (a policy with no plan that fits is absent)."""
    spec = model_spec(model)
    hw = hardware_for(n_gpus or preset(hardware).n_gpus, hardware)
    t0 = time.perf_counter()
    try:
        df = search(spec, hw, minibatch, policies=policies, n_gpus=n_gpus, workers=workers)
    except OutOfMemoryError:
        df = pd.DataFrame(columns=["policy", "iteration_s", "plan"])
        df.attrs.update(simulated=0)
    per_policy = {p: rows.iloc[0] for p, rows in df.groupby("policy", sort=False)}
    return Best(model, minibatch, per_policy, time.perf_counter() - t0, int(df.attrs.get("simulated", 0)), df)


def _plan_text(row: pd.Series | None) -> str | None:
    return None if row is None else row["plan"].describe()


def _get(row: pd.Series | None, key: str) -> float:
    return math.nan if row is None else float(row[key])


# ---- 10: swap volume --------------------------------------------------------------
def swap_volume_table(models: Sequence[str], minibatches: Sequence[int], hardware: str = HARDWARE,
                      workers: int | None = None) -> pd.DataFrame:
    """Host<->GPU bytes per iteration of the fastest Harmony plan (pipeline or
    data parallel), the fastest pipeline plan, the Harmony plan that moves
    least, and the fastest virtualized-memory plan, each the search's pick."""
    rows = []
    for model in models:
        for mb in minibatches:
            best = best_plans(model, mb, hardware, workers=workers)
            h, pp, vm = best.fastest(HARMONY_POLICIES), best.per_policy.get("harmony-pp"), best.per_policy.get(BASELINE)
            harmony_rows = best.table[best.table["policy"].isin(HARMONY_POLICIES)]
            leanest = None if harmony_rows.empty else harmony_rows.sort_values("swap_gb").iloc[0]
            rows.append({
                "model": model, "minibatch": mb,
                "harmony_plan": _plan_text(h), "harmony_swap_gb": _get(h, "swap_gb"),
                "harmony_iteration_s": _get(h, "iteration_s"),
                "harmony_pp_swap_gb": _get(pp, "swap_gb"), "harmony_min_swap_gb": _get(leanest, "swap_gb"),
                "baseline_plan": _plan_text(vm), "baseline_swap_gb": _get(vm, "swap_gb"),
                "baseline_iteration_s": _get(vm, "iteration_s"),
                "search_s": best.search_s,
            })
    df = pd.DataFrame(rows)
    df["swap_ratio"] = df["baseline_swap_gb"] / df["harmony_swap_gb"]
    df["swap_ratio_pp"] = df["baseline_swap_gb"] / df["harmony_pp_swap_gb"]
    df["swap_ratio_min"] = df["baseline_swap_gb"] / df["harmony_min_swap_gb"]
    return df


def swap_volume_chart(df: pd.DataFrame, title: str = ""):
    names = {"harmony_swap_gb": "Harmony (fastest plan)", "harmony_pp_swap_gb": "Harmony-PP (fastest)",
             "harmony_min_swap_gb": "Harmony (least swap)", "baseline_swap_gb": "virtual memory (fastest)"}
    long = df.melt(id_vars=["model", "minibatch"], value_vars=list(names), var_name="system", value_name="swap_GB")
    long["system"] = long["system"].map(names)
    long["case"] = long["model"] + " / " + long["minibatch"].astype(str)
    return bar_chart(long.dropna(subset=["swap_GB"]), "case", "swap_GB", "system", title=title, log=True,
                        y_title="host<->GPU GB per iteration (log)")


# ---- 11: throughput ---------------------------------------------------------------
def throughput_table(models: Sequence[str], minibatches: Sequence[int], hardware: str = HARDWARE,
                     workers: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulated samples/s of the fastest plan of each policy. Returns (long: one
    row per model, minibatch and policy; wide: one row per model and minibatch
    with the speedups of Harmony over virtual memory)."""
    long_rows, wide_rows = [], []
    policies = (*HARMONY_POLICIES, BASELINE)
    for model in models:
        for mb in minibatches:
            best = best_plans(model, mb, hardware, workers=workers)
            wide = {"model": model, "minibatch": mb, "search_s": best.search_s}
            for p in policies:
                r = best.per_policy.get(p)
                long_rows.append({"model": model, "minibatch": mb, "policy": p, "plan": _plan_text(r),
                                  "samples_per_s": _get(r, "samples_per_s"), "iteration_s": _get(r, "iteration_s"),
                                  "swap_gb": _get(r, "swap_gb"),
                                  "limited_by": None if r is None else r["limited_by"]})
                wide[f"{p}_samples_per_s"] = _get(r, "samples_per_s")
            vm = wide[f"{BASELINE}_samples_per_s"]
            for p in HARMONY_POLICIES:
                wide[f"speedup_{p}"] = wide[f"{p}_samples_per_s"] / vm
            wide["speedup"] = max(wide[f"{p}_samples_per_s"] for p in HARMONY_POLICIES) / vm
            wide_rows.append(wide)
    return pd.DataFrame(long_rows), pd.DataFrame(wide_rows)


def throughput_chart(long: pd.DataFrame, title: str = ""):
    df = long.assign(case=long["model"] + " / " + long["minibatch"].astype(str)).dropna(subset=["samples_per_s"])
    return bar_chart(df[["case", "policy", "samples_per_s", "plan"]], "case", "samples_per_s", "policy",
                        title=title, y_title="samples/s (simulated)")


# ---- 12: pack size x microbatch size -------------------------------------------------
def packs_of(num_layers: int, size: int) -> tuple[Pack, ...]:
    """Backward packs of ``size`` layers, cut from the last layer (so the fused
    last pack is full and the first one takes the remainder)."""
    if size < 1:
        raise HarmonyError(f"pack size must be >= 1, got {size}")
    bounds = list(range(num_layers, 0, -size)) + [0]
    return tuple(reversed([(max(a, 0), b) for b, a in zip(bounds[:-1], bounds[1:])]))


def pack_microbatch_grid(model: str = "bert-large", minibatch: int = 64, n_gpus: int = 4,
                         pack_sizes: Sequence[int] = (1, 2, 4, 7, 14), microbatches: Sequence[int] = (1, 2, 4, 8),
                         policy: str = "harmony-pp", hardware: str = HARDWARE) -> pd.DataFrame:
    """Simulated iteration time of ``policy`` for every (layers per backward
    pack, microbatch size) with uF = uB and forward packs on the backward
    boundaries. ``iteration_s`` is NaN where the plan does not fit in GPU memory
    (``status`` says why)."""
    from ..costs.reference import max_profiled

    spec = model_spec(model)
    hw = hardware_for(n_gpus, hardware)
    _, cap = max_profiled(spec)
    rows = []
    for size in pack_sizes:
        bwd = packs_of(len(spec), size)
        for u in microbatches:
            row = {"pack_size": size, "microbatch": u, "packs": len(bwd), "iteration_s": math.nan,
                   "samples_per_s": math.nan, "peak_memory_gb": math.nan, "swap_gb": math.nan}
            if u > minibatch:
                row["status"] = "microbatch > minibatch"
            elif cap is not None and u > cap:
                row["status"] = f"not profiled (max {cap})"
            else:
                plan = Plan(policy, n_gpus, minibatch, u, u, bwd[:-1], bwd)
                s = simulate(spec, hw, plan).summary
                peak = max(s.peak_memory.values())
                row.update(peak_memory_gb=peak / 1e9, swap_gb=s.swap_bytes / 1e9,
                           status="ok" if s.fits else "out of memory")
                if s.fits:
                    row.update(iteration_s=s.iteration_s, samples_per_s=s.samples_per_s)
            rows.append(row)
    return pd.DataFrame(rows)


def heatmap_chart(df: pd.DataFrame, title: str = ""):
    """Iteration time per (pack size, microbatch); cells that do not fit are grey and labelled."""
    import altair as alt

    df = df.assign(label=[f"{t:.3g}" if t == t else ("OOM" if s == "out of memory" else "–")
                          for t, s in zip(df["iteration_s"], df["status"])])
    base = alt.Chart(df).encode(x=alt.X("microbatch:O", title="microbatch size (uF = uB)"),
                                y=alt.Y("pack_size:O", title="layers per backward pack", sort="ascending"))
    tooltip = ["pack_size", "packs", "microbatch", "iteration_s", "peak_memory_gb", "swap_gb", "status"]
    grey = base.mark_rect(color="#dddddd").encode(tooltip=tooltip)  # every cell; shows where nothing fits
    cells = base.mark_rect().encode(
        color=alt.Color("iteration_s:Q", title="iteration (s)", scale=alt.Scale(scheme="viridis", reverse=True)),
        tooltip=tooltip)
    lo, hi = df["iteration_s"].min(), df["iteration_s"].max()
    dark = lo + 0.6 * (hi - lo) if hi == hi else math.inf  # label dark cells in white
    text = base.mark_text(fontSize=10).encode(
        text="label:N", color=alt.condition(f"datum.iteration_s > {dark}", alt.value("white"), alt.value("black")))
    return (grey + cells + text).properties(title=title, width=max(240, 48 * df["microbatch"].nunique()),
                                     height=max(160, 28 * df["pack_size"].nunique()))


# ---- 13: the planner's choices ---------------------------------------------------
def planner_table(models: Sequence[str], minibatch: int = 64, policy: str = "harmony-pp", n_gpus: int = 4,
                  hardware: str = HARDWARE, workers: int | None = None) -> pd.DataFrame:
    """The configuration the search picks for each model, and how long it took
    (column ``plan`` holds the :class:`Plan`, ``plan_text`` its description)."""
    rows = []
    for model in models:
        best = best_plans(model, minibatch, hardware, policies=[policy], n_gpus=n_gpus, workers=workers)
        r = best.per_policy.get(policy)
        plan: Plan | None = None if r is None else r["plan"]
        rows.append({
            "model": model, "layers": len(model_spec(model)), "minibatch": minibatch, "policy": policy,
            "n_gpus": n_gpus,
            "uF": None if plan is None else plan.fwd_microbatch, "uB": None if plan is None else plan.bwd_microbatch,
            "fwd_packs": None if plan is None else len(plan.fwd_packs),
            "bwd_packs": None if plan is None else len(plan.bwd_packs),
            "iteration_s": _get(r, "iteration_s"), "samples_per_s": _get(r, "samples_per_s"),
            "peak_memory_gb": _get(r, "peak_memory_gb"), "swap_gb": _get(r, "swap_gb"),
            "plans_simulated": best.simulated, "search_s": best.search_s,
            "plan_text": None if plan is None else plan.describe(), "plan": plan,
        })
    return pd.DataFrame(rows)


def search_time_chart(df: pd.DataFrame, title: str = ""):
    """Search time per model, each bar labelled with the configuration chosen."""
    import altair as alt

    df = df.drop(columns=["plan"], errors="ignore").assign(
        config=[f"uF={f} uB={b}, {n} packs" for f, b, n in zip(df["uF"], df["uB"], df["bwd_packs"])])
    base = alt.Chart(df).encode(x=alt.X("model:N", sort=None), y=alt.Y("search_s:Q", title="search time (s)"))
    return (base.mark_bar() + base.mark_text(dy=-6).encode(text="config:N")).properties(
        title=title, width=max(200, 130 * len(df)))


# ---- 14: scaling with GPUs -----------------------------------------------------------
def scaling_table(models: Sequence[str], gpu_counts: Sequence[int], minibatch: int,
                  policies: Sequence[str] = HARMONY_POLICIES, hardware: str = HARDWARE,
                  workers: int | None = None) -> pd.DataFrame:
    """Best simulated throughput for each GPU count and its scaling efficiency
    ``throughput_N * n0 / (N * throughput_n0)`` against the smallest count n0."""
    rows = []
    counts = sorted(gpu_counts)
    for model in models:
        for n in counts:
            best = best_plans(model, minibatch, hardware, policies=policies, n_gpus=n, workers=workers)
            r = best.fastest(policies)
            rows.append({"model": model, "n_gpus": n, "hardware": hardware_for(n, hardware).name,
                         "minibatch": minibatch, "policy": None if r is None else r["policy"],
                         "plan": _plan_text(r), "samples_per_s": _get(r, "samples_per_s"),
                         "iteration_s": _get(r, "iteration_s"), "search_s": best.search_s})
    df = pd.DataFrame(rows)
    first = df.groupby("model")["samples_per_s"].transform("first")
    df["speedup"] = df["samples_per_s"] / first
    df["efficiency"] = df["speedup"] * counts[0] / df["n_gpus"]
    return df


def scaling_chart(df: pd.DataFrame, title: str = ""):
    import altair as alt

    n0 = df["n_gpus"].min()
    ideal = df.assign(samples_per_s=df.groupby("model")["samples_per_s"].transform("first") * df["n_gpus"] / n0)
    x = alt.X("n_gpus:Q", title="GPUs", scale=alt.Scale(type="log", base=2), axis=alt.Axis(values=sorted(
        df["n_gpus"].unique().tolist())))
    measured = alt.Chart(df).mark_line(point=True).encode(
        x=x, y=alt.Y("samples_per_s:Q", title="samples/s (simulated)", scale=alt.Scale(type="log")), color="model:N",
        tooltip=["model", "n_gpus", "policy", "plan", "samples_per_s", "efficiency"])
    linear = alt.Chart(ideal).mark_line(strokeDash=[4, 4], opacity=0.5).encode(x=x, y="samples_per_s:Q",
                                                                              color="model:N")
    eff = alt.Chart(df).mark_line(point=True).encode(
        x=x, y=alt.Y("efficiency:Q", title="scaling efficiency", scale=alt.Scale(domain=[0, 1.1])), color="model:N")
    return alt.hconcat((measured + linear).properties(title=title or "throughput (dashed: linear)"),
                       eff.properties(title="throughput_N / (N x throughput_1)"))


# ---- real training: the engine vs the plain loop ---------------------------------------
def gpt2_tiny(seed: int = 0, dropout: float = 0.0, **overrides):
    """The zoo's toy GPT-2 as an ``nn.Sequential`` of vLayers without the loss layer."""
    return build_model("gpt2-tiny", seed, dropout=dropout, **overrides)


def synthetic_batches(n: int, minibatch: int, seed: int = 1, **overrides) -> list[tuple]:
    """``n`` random (token ids, targets) minibatches for the toy GPT-2."""
    import torch

    from ..costs import zoo

    torch.manual_seed(seed)
    return [zoo.example_input("gpt2-tiny", minibatch, **overrides) for _ in range(n)]


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
        return max(float((a.detach() - b.detach()).abs().max())
                   for a, b in zip(self.engine.model.parameters(), self.reference_model.parameters()))

    @property
    def bitwise_equal(self) -> bool:
        import torch

        return all(torch.equal(a, b) for a, b in zip(self.engine.model.parameters(),
                                                      self.reference_model.parameters()))


def train_side_by_side(steps: int, minibatch: int, device, plan: Plan | str = "auto", microbatch: int | None = None,
                       lr: float = 1e-3, dropout: float = 0.0, n_batches: int = 2, seed: int = 0,
                       threads: int | None = 1, **model_overrides) -> TrainingRun:
    """Train the toy GPT-2 for ``steps`` with :class:`harmony.Engine` on
    ``device`` under ``plan``, and an identical copy with
    :func:`harmony.reference_step` (the plain PyTorch loop) at the engine's
    backward microbatch size (or ``microbatch``), on the same batches, with
    ``threads`` torch threads."""
    with torch_threads(threads):
        return _train_side_by_side(steps, minibatch, device, plan, microbatch, lr, dropout, n_batches, seed,
                                   **model_overrides)


def _train_side_by_side(steps, minibatch, device, plan, microbatch, lr, dropout, n_batches, seed,
                        **model_overrides) -> TrainingRun:
    from ..engine import Engine, reference_step

    data = synthetic_batches(n_batches, minibatch, seed=seed + 1, **model_overrides)
    engine = Engine(gpt2_tiny(seed, dropout, **model_overrides), adamw(lr), lm_loss, device=device,
                    minibatch_size=minibatch, plan=plan, seed=seed)
    t0 = time.perf_counter()
    eng = [engine.step(x, y) for x, y in (data[i % len(data)] for i in range(steps))]
    t_engine = time.perf_counter() - t0
    u = microbatch or engine.plan.bwd_microbatch
    ref_model = gpt2_tiny(seed, dropout, **model_overrides)
    opt = adamw(lr)(list(ref_model.parameters()))
    t0 = time.perf_counter()
    ref = [reference_step(list(ref_model), lm_loss, opt, x, y, u, step, seed=seed)
           for step, (x, y) in enumerate(data[i % len(data)] for i in range(steps))]
    t_ref = time.perf_counter() - t0
    losses = pd.DataFrame({"step": range(steps), "engine": eng, "reference": ref})
    losses["abs_diff"] = (losses["engine"] - losses["reference"]).abs()
    return TrainingRun(engine, ref_model, losses, u, t_engine, t_ref)


def loss_chart(losses: pd.DataFrame, title: str = ""):
    """Both loss curves, the engine's dashed on top of the plain loop's."""
    import altair as alt

    long = losses.melt(id_vars="step", value_vars=["reference", "engine"], var_name="run", value_name="loss")
    long["run"] = long["run"].map({"reference": "plain PyTorch loop", "engine": "harmony.Engine"})
    return alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("step:O"), y=alt.Y("loss:Q", scale=alt.Scale(zero=False)), color="run:N",
        strokeDash=alt.StrokeDash("run:N", legend=None),
        tooltip=["run", "step", alt.Tooltip("loss:Q", format=".8f")],
    ).properties(title=title, width=480, height=240)


def activation_bytes(spec, minibatch: int) -> float:
    """Bytes autograd saves for a whole minibatch run at once (from a measured profile)."""
    return float(sum(c.bwd_extra(minibatch) for c in spec.layers))


def training_footprint(model, activations: float = 0.0) -> float:
    """Bytes of weights, gradients and AdamW's two states, plus ``activations``."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * params + activations


def harmony_plan_for(num_layers: int, minibatch: int, microbatch: int, layers_per_pack: int,
                     policy: str = "harmony-pp", n_gpus: int = 1, fwd_microbatch: int | None = None) -> Plan:
    """A plan with backward packs of ``layers_per_pack`` layers and forward packs
    on the same boundaries; forward microbatch = backward unless given."""
    bwd = packs_of(num_layers, layers_per_pack)
    return Plan(policy, n_gpus, minibatch, fwd_microbatch or microbatch, microbatch, bwd[:-1], bwd)


def exactness_variants(steps: int, minibatch: int, microbatch: int, layers_per_pack: int, dropout: float,
                       memory: str, bandwidth: str, lr: float, seed: int, multi_gpu: int = 2,
                       threads: int | None = 1) -> tuple[
                           pd.DataFrame, dict[str, TrainingRun]]:
    """Train the toy GPT-2 with the engine under several plans and with the
    plain loop, and compare. One row per variant: what it is, what is
    expected, max |loss difference|, max |weight difference|, bitwise equal.
    Variants on ``multi_gpu`` emulated GPUs need the engine's multi-GPU
    support; where it is missing the row says so (status) instead."""
    from .. import engine as engine_module

    n_layers = len(gpt2_tiny(seed))
    one = engine_module.EmulatedDevice(memory=memory, h2d=bandwidth, d2h=bandwidth)
    variants = [
        ("harmony-pp x1, uF = uB", "bitwise", dropout, one,
         harmony_plan_for(n_layers, minibatch, microbatch, layers_per_pack)),
        ("virtual-memory x1", "bitwise", dropout, one,
         harmony_plan_for(n_layers, minibatch, microbatch, layers_per_pack, policy=BASELINE)),
        ("harmony-pp x1, uF = 2 uB (no dropout)", "allclose (forward batched differently)", 0.0, one,
         harmony_plan_for(n_layers, minibatch, microbatch, layers_per_pack,
                          fwd_microbatch=min(2 * microbatch, minibatch))),
    ]
    server_cls = getattr(engine_module, "EmulatedServer", None)
    multi = []
    for policy, expected in (("harmony-pp", "bitwise"), ("harmony-dp", "allclose (gradients summed across GPUs)")):
        multi.append((f"{policy} x{multi_gpu}", expected, dropout,
                      None if server_cls is None else server_cls(gpus=multi_gpu, memory=memory, h2d=bandwidth,
                                                                 d2h=bandwidth),
                      harmony_plan_for(n_layers, minibatch, microbatch, layers_per_pack, policy=policy,
                                       n_gpus=multi_gpu)))
    rows, runs = [], {}
    for name, expected, p, device, plan in variants + multi:
        row = {"variant": name, "plan": plan.describe(), "dropout": p, "expected": expected}
        if device is None:
            rows.append({**row, "status": "not run: this engine has no EmulatedServer (multi-GPU emulation)"})
            continue
        try:
            run = train_side_by_side(steps, minibatch, device, plan=plan, microbatch=microbatch, lr=lr, dropout=p,
                                     seed=seed, threads=threads)
        except (HarmonyError, NotImplementedError, TypeError, ValueError) as e:
            rows.append({**row, "status": f"not run: {type(e).__name__}: {e}"})
            continue
        runs[name] = run
        rows.append({**row, "status": "ran", "max_loss_diff": run.max_loss_diff,
                     "max_weight_diff": run.max_weight_diff, "bitwise_equal": run.bitwise_equal,
                     "engine_s": run.seconds_engine, "reference_s": run.seconds_reference})
    return pd.DataFrame(rows), runs


def baseline_comparison(engine, device, batch: tuple, run_engine: bool = True, threads: int | None = 1) -> pd.DataFrame:
    """Bytes over the emulated link per step: the engine's Harmony plan (as
    measured and as simulated on the engine's measured profile) against the
    best virtualized-memory plan for the same device (simulated and, with
    ``run_engine``, run for one step in a fresh engine)."""
    from ..engine import Engine

    hw = device.hardware()
    spec = engine.profile or engine.spec
    vm = search(spec, hw, engine.minibatch_size, policies=[BASELINE], n_gpus=1, workers=1).iloc[0]["plan"]
    rows = []
    for policy, plan in (("harmony-pp", engine.plan), (BASELINE, vm)):
        sim = simulate(spec, hw, plan).summary
        rows.append({"policy": policy, "plan": plan.describe(), "how": "simulated",
                     "swap_mb": sim.swap_bytes / 1e6, "iteration_s": sim.iteration_s,
                     "peak_mb": max(sim.peak_memory.values()) / 1e6})
    measured = engine.trace.summary
    rows.append({"policy": "harmony-pp", "plan": engine.plan.describe(), "how": "measured (engine)",
                 "swap_mb": measured.swap_bytes / 1e6, "iteration_s": measured.iteration_s,
                 "peak_mb": max(measured.peak_memory.values()) / 1e6})
    if run_engine:
        other = Engine(gpt2_tiny(engine.seed), adamw(1e-3), engine.loss_fn, device=device,
                       minibatch_size=engine.minibatch_size, plan=vm, seed=engine.seed)
        x, y = batch
        with torch_threads(threads):
            other.step(x, y)
        s = other.trace.summary
        rows.append({"policy": BASELINE, "plan": vm.describe(), "how": "measured (engine)",
                     "swap_mb": s.swap_bytes / 1e6, "iteration_s": s.iteration_s,
                     "peak_mb": max(s.peak_memory.values()) / 1e6})
    return pd.DataFrame(rows)


def median_step_s(engine, inputs: tuple, target, steps: int) -> float:
    """Median wall time of ``steps`` engine steps after a warm-up step."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        engine.step(inputs, target)
        times.append(time.perf_counter() - t0)
    return float(pd.Series(times[1:]).median())


def emulated_throughput(gpus: int = 2, minibatch: int = 16, microbatch: int = 2, layers_per_pack: int = 1,
                        steps: int = 2, memory: str = "4MB", bandwidth: str = "20MB/s", seed: int = 0,
                        threads: int | None = 1, **model_overrides) -> pd.DataFrame:
    """Samples/s of the toy GPT-2 measured by the engine on an emulated server
    of ``gpus`` GPUs (per-GPU links of ``bandwidth``, one uplink as fast as two
    of them), for Harmony-PP, Harmony-DP and the virtual-memory baseline on
    the same packs and microbatches (median step after a warm-up)."""
    from ..engine import EmulatedServer, Engine

    server = EmulatedServer(gpus=gpus, memory=memory, h2d=bandwidth, d2h=bandwidth, p2p=bandwidth)
    rows = []
    with torch_threads(threads):
        n = len(gpt2_tiny(seed, **model_overrides))
        (x,), y = synthetic_batches(1, minibatch, seed=seed + 1, **model_overrides)[0]
        for policy in ("harmony-pp", "harmony-dp", BASELINE):
            plan = harmony_plan_for(n, minibatch, microbatch, layers_per_pack, policy=policy, n_gpus=gpus)
            engine = Engine(gpt2_tiny(seed, **model_overrides), adamw(1e-3), lm_loss, device=server,
                            minibatch_size=minibatch, plan=plan, seed=seed)
            step_s = median_step_s(engine, (x,), y, steps)
            rows.append({"policy": policy, "gpus": gpus, "plan": plan.describe(), "step_s": step_s,
                         "samples_per_s": minibatch / step_s,
                         "swap_mb": engine.trace.summary.swap_bytes / 1e6})
    df = pd.DataFrame(rows)
    base = df.loc[df.policy == BASELINE, "samples_per_s"].iloc[0]
    df["speedup_vs_baseline"] = df["samples_per_s"] / base
    return df


# ---- 16: simulator fidelity ------------------------------------------------------------
def fidelity_grid(pack_sizes: Sequence[int], microbatches: Sequence[int], minibatch: int = 16, steps: int = 3,
                  memory: str = "8MB", bandwidth: str = "50MB/s", seed: int = 0, threads: int | None = 1,
                  **model_overrides) -> pd.DataFrame:
    """Simulated vs measured iteration time and peak device memory of harmony-pp
    plans (layers per backward pack x microbatch size) for the toy GPT-2 on an
    emulated GPU. The simulator plays the plan on the model's profile measured
    here and the engine's cost per task measured on the same device; the engine
    runs it (median over ``steps`` after a warm-up step)."""
    from ..engine import EmulatedDevice, Engine
    from ..engine.calibrate import calibrate
    from ..engine.profiler import profile

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
                plan = harmony_plan_for(len(spec), minibatch, u, size)
                sim = simulate(spec, hw, plan).summary
                row = {"layers_per_pack": size, "microbatch": u, "plan": plan.describe(),
                       "simulated_s": sim.iteration_s, "simulated_peak_mb": sim.peak_memory["gpu0"] / 1e6}
                if not sim.fits:
                    rows.append({**row, "status": "over memory (simulated)"})
                    continue
                engine = Engine(gpt2_tiny(seed, **model_overrides), adamw(1e-3), lm_loss, device=device,
                                minibatch_size=minibatch, plan=plan, seed=seed, spec=spec)
                rows.append({**row, "status": "ran", "measured_s": median_step_s(engine, (x,), y, steps),
                             "measured_peak_mb": engine.trace.summary.peak_memory["gpu0"] / 1e6})
    df = pd.DataFrame(rows)
    if "measured_s" in df:
        df["time_ratio"] = df["measured_s"] / df["simulated_s"]
        df["peak_ratio"] = df["measured_peak_mb"] / df["simulated_peak_mb"]
    return df


def fidelity_chart(df: pd.DataFrame, title: str = ""):
    """Measured against simulated, time and peak memory, with the y = x line."""
    import altair as alt

    ran = df[df.status == "ran"]

    def scatter(x: str, y: str, label: str):
        top = float(max(ran[x].max(), ran[y].max())) * 1.1
        line = alt.Chart(pd.DataFrame({"v": [0.0, top]})).mark_line(color="gray", strokeDash=[4, 4]).encode(
            x=alt.X("v:Q", title=f"simulated {label}"), y=alt.Y("v:Q", title=f"measured {label}"))
        dots = alt.Chart(ran).mark_circle(size=80).encode(
            x=f"{x}:Q", y=f"{y}:Q", color=alt.Color("layers_per_pack:O", title="layers per pack"),
            shape=alt.Shape("microbatch:O"), tooltip=list(ran.columns))
        return (line + dots).properties(width=260, height=260, title=label)

    return alt.hconcat(scatter("simulated_s", "measured_s", "iteration time (s)"),
                       scatter("simulated_peak_mb", "measured_peak_mb", "peak memory (MB)")).properties(title=title)


# ---- every system side by side; many models at once ------------------------------------
def _moved_gb(summary: Summary) -> dict[str, float]:
    kinds = summary.bytes_by_kind
    return {"host_gpu_gb": summary.swap_bytes / 1e9,
            "gpu_gpu_gb": (kinds.get("P2P", 0.0) + kinds.get("REDUCE", 0.0)) / 1e9}


def systems_table(models: Sequence[str], minibatches: Sequence[int], hardware: str = HARDWARE,
                  policies: Sequence[str] | None = None, workers: int | None = None) -> pd.DataFrame:
    """Simulated samples/s and bytes moved per iteration of every system's best
    plan, per model and minibatch, with samples/s over the virtual-memory baseline's."""
    hw = preset(hardware)
    rows = []
    for model in models:
        spec = model_spec(model)
        for minibatch in minibatches:
            for policy, plan in plans_for(policies, spec, hw, minibatch, workers).items():
                s = simulate(spec, hw, plan).summary
                rows.append({"model": model, "minibatch": minibatch, "policy": policy, "plan": plan.describe(),
                             "n_gpus": plan.n_gpus, "samples_per_s": s.samples_per_s, **_moved_gb(s)})
    df = pd.DataFrame(rows)
    base = df[df.policy == BASELINE].set_index(["model", "minibatch"]).samples_per_s
    df["vs_virtual_memory"] = [r.samples_per_s / base.get((r.model, r.minibatch), math.nan)
                               for r in df.itertuples()]
    return df


def systems_chart(df: pd.DataFrame, title: str = ""):
    """Samples/s of every system, one group of bars per model and minibatch."""
    long = df.assign(case=[f"{m}, B={b}" for m, b in zip(df.model, df.minibatch)])
    return bar_chart(long, "case", "samples_per_s", color="policy", title=title, y_title="samples/s (simulated)")


def depth_grid_jobs(model: str, depths: Sequence[int], minibatch: int, steps: int,
                    hardware: str = HARDWARE) -> list[Job]:
    """A model-selection workload: ``model`` (a reference profile: an embedding,
    a run of identical blocks, then its head) cut to each depth in ``depths``,
    each a :class:`~harmony.planner.multi_model.Job` with its best 1-GPU Harmony plan and
    its best plan over all GPUs (used when models run one after another)."""
    full, hw = model_spec(model), preset(hardware)
    kind = full.layers[1].name.partition(":")[2]
    blocks = next((i - 1 for i, c in enumerate(full.layers[1:], 1) if c.name.partition(":")[2] != kind), len(full) - 1)
    jobs = []
    for depth in depths:
        if not 1 <= depth <= blocks:
            raise HarmonyError(f"{model} has {blocks} blocks; depths must be between 1 and {blocks}, got {depth}")
        spec = replace(full, name=f"{model}-{depth}L", layers=full.layers[:1 + depth] + full.layers[1 + blocks:])
        one = search(spec, hw, minibatch, policies=HARMONY_POLICIES[:1], n_gpus=1, workers=1).iloc[0].plan
        wide = search(spec, hw, minibatch, policies=HARMONY_POLICIES, n_gpus=hw.n_gpus, workers=1).iloc[0].plan
        jobs.append(Job(spec, one, steps, spec.name, wide))
    return jobs


def schedules_table(jobs: list[Job], hardware: str = HARDWARE) -> pd.DataFrame:
    """Total time to train every job under each schedule of
    :func:`~harmony.planner.multi_model.compare_schedules`, plus one model at a time on one GPU."""
    hw = preset(hardware)
    df = compare_schedules(jobs, hw)
    alone = simulate_many([replace(j, parallel_plan=None) for j in jobs], hw, "sequential").row()
    alone["schedule"] = "sequential, 1 GPU"
    alone["over_merged"] = alone["total_s"] / df.set_index("schedule").total_s["merged"]
    return pd.concat([df, pd.DataFrame([alone])], ignore_index=True)


# ---- writing results -------------------------------------------------------------------
# ---- 18: Harmony vs PyTorch's own offload ------------------------------------------------
def gpt2_config(hidden: int, blocks: int, seq_len: int, vocab: int) -> dict[str, int]:
    """Settings of the zoo's ``gpt2-tiny`` for a GPT-2 of ``blocks`` x ``hidden`` (heads of 64)."""
    return dict(hidden=hidden, n_layer=blocks, heads=max(1, hidden // 64), seq_len=seq_len, max_position=seq_len,
                vocab=vocab)


def torch_offload_comparison(hidden: int = 256, blocks: int = 6, minibatch: int = 32, memory: str = "56MB",
                             steps: int = 5, seq_len: int = 64, vocab: int = 512, link: float | str | None = None,
                             threads: int | None = 1) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Harmony and PyTorch's own offload (:class:`~harmony.workbench.baselines.TorchOffload`)
    training one GPT-2 (``blocks`` x ``hidden``) on one emulated GPU of ``memory``
    with links of ``link`` bytes/s (default: the 1080 Ti's compute : bandwidth
    ratio to this CPU, :func:`~harmony.engine.profiler.link_like_1080ti`).

    Harmony runs the best harmony-pp plan for the profile measured here; the
    recipe runs the microbatch size a user would pick (the fastest that fits,
    tried from the minibatch down). Both use FlatAdamW and start from the same
    weights. ``steps`` steps of each, interleaved (drift in the machine's load
    hits both alike) after a warm-up step; samples/s from the median step.
    Returns one row per system and the details: sizes, the link, the recipe's
    tuning, how far apart the two systems' weights are after the first step.
    A recipe that fits at no microbatch size gets a row saying so."""
    def optimizer(params):
        return FlatAdamW(params, lr=1e-4)

    with torch_threads(threads):
        rate = link_like_1080ti() if link is None else parse_rate(link, "link")
        device = EmulatedDevice(memory=memory, h2d=rate, d2h=rate)
        cfg = gpt2_config(hidden, blocks, seq_len, vocab)
        model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
        (x,), y = example_input("gpt2-tiny", minibatch, **cfg)
        spec = profile(list(model), (x,), y, lm_loss, optimizer, name=f"gpt2 {blocks}x{hidden}")
        params = sum(p.numel() for p in model.parameters())
        hw = calibrate(device)
        best = search(spec, hw, minibatch, policies=("harmony-pp",), n_gpus=1, workers=1).iloc[0]
        plan = best["plan"]
        details: dict[str, Any] = {
            "model": f"GPT-2 {blocks} x {hidden}, seq {seq_len}", "params": params, "link_mb_s": rate / 1e6,
            "capacity_mb": device.capacity / 1e6, "weights_mb": params * 4 / 1e6,
            "footprint_mb": (params * 16 + sum(c.bwd_extra(minibatch) for c in spec.layers)) / 1e6,
            "harmony_plan": plan.describe(), "harmony_simulated_s": float(best["iteration_s"]), "tuning": []}

        def recipe(u: int) -> TorchOffload:
            return TorchOffload(copy.deepcopy(model), optimizer, lm_loss, device, u, spec)

        try:  # weights and gradients alone may not fit, whatever the microbatch size
            recipe(minibatch)
        except OutOfMemoryError:
            u = None
        else:
            u = fastest_microbatch(lambda u: timed(lambda: recipe(u).step(x, y)),
                                   default_sizes(minibatch) + [plan.fwd_microbatch], log=details["tuning"].append)
        systems = {"harmony-pp": Engine(copy.deepcopy(model), optimizer, lm_loss, device=device,
                                        minibatch_size=minibatch, plan=plan)}
        if u is not None:
            systems["torch offload"] = recipe(u)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for step in range(steps + 1):
            for name, system in systems.items():
                times[name].append(timed(lambda: system.step(x, y)))
            if step == 0 and u is not None:
                details["first_step_max_weight_diff"] = max(
                    (a - b).abs().max().item() for a, b in zip(systems["harmony-pp"].model.parameters(),
                                                                systems["torch offload"].master))
    rows = []
    for name, system in systems.items():
        seconds = statistics.median(times[name][1:])
        if isinstance(system, Engine):
            s = system.trace.summary
            moved, peak, micro = s.swap_bytes, s.peak_memory["gpu0"], f"{plan.fwd_microbatch}/{plan.bwd_microbatch}"
        else:
            moved, peak, micro = sum(system.moved.values()), system.peak_memory, str(u)
        rows.append({"system": name, "status": "ran", "microbatch": micro, "step_s": seconds,
                     "samples_per_s": minibatch / seconds, "host_link_mb": moved / 1e6, "peak_mb": peak / 1e6,
                     "peak_share": peak / device.capacity})
    if u is None:
        rows.append({"system": "torch offload", "status": "does not fit at any microbatch size"})
    df = pd.DataFrame(rows)
    first = df.iloc[0]
    df["harmony_speedup"] = first.samples_per_s / df.samples_per_s
    df["harmony_bytes_ratio"] = first.host_link_mb / df.host_link_mb
    return df, details


def torch_offload_chart(df: pd.DataFrame, title: str | list[str] = ""):
    """Samples/s of Harmony and of PyTorch's own offload, side by side."""
    return bar_chart(df[df.status == "ran"], "system", "samples_per_s", title=title, y_title="samples/s (measured)")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, pd.DataFrame):
        return _jsonable(value.to_dict(orient="records"))
    if isinstance(value, Plan):
        return value.to_dict()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def write_outputs(out_dir: str | Path, results: dict[str, Any], tables: dict[str, pd.DataFrame] | None = None,
                  charts: dict[str, Any] | None = None) -> list[Path]:
    """Write ``results.json``, each table as ``<name>.csv`` and each chart as
    ``<name>.svg`` and ``<name>.png`` into ``out_dir``; return the paths.
    By convention the main table is ``data`` and the main chart ``figure``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json"]
    paths[0].write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    for name, df in (tables or {}).items():
        path = out / f"{name}.csv"
        df.to_csv(path, index=False)
        paths.append(path)
    for name, chart in (charts or {}).items():
        paths += save(chart, out / name)
    return paths
