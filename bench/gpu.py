"""Harmony on one real GPU, in one table: is it fast where it should be?

Four sections, each in its own try/except and time limit (a section that fails
or runs out of time says so in its rows, and the others still run), so one
call of at most 10 minutes yields the whole table (4-5 minutes on one H100):

(a) a GPT-2 that fits the GPU (12 x 1024, seq 1024, minibatch 8, bf16, 255 M
    parameters): the plain PyTorch loop on the GPU (fused AdamW there) vs
    ``Engine(plan="auto")`` (which should pick the resident plan: everything on
    the GPU), their ratio, the engine's time to its first step (profile and
    search included) and its measured / simulated step time;
(b) a GPT-2 that does not fit its memory (24 x 2048, 1.42 B parameters, the GPU
    capped at 16 GB): harmony (``plan="auto"``) vs PyTorch's offload recipe
    (``TorchOffload``), FSDP2 + ``CPUOffloadPolicy`` and DeepSpeed ZeRO-Offload
    (where ``deepspeed`` imports): samples/s, model-FLOPs utilization and the
    physical floor of a step, max(GPU compute at the measured matmul peak,
    the PCIe bytes an offload must move (bf16 weights in, bf16 gradients out)
    at the measured link bandwidth, the CPU update's bytes at the measured
    FlatAdamW bandwidth);
(c) the simulator against the runs of (a) and (b): measured / simulated step
    time, the engine's ledger peak, the simulated peak and
    ``torch.cuda.max_memory_allocated``;
(d) exactness under ``torch.use_deterministic_algorithms(True)``: the engine
    (a harmony-pp plan of several packs, and the resident plan) against
    ``harmony.reference_step`` on the same device, float32: bitwise or not.

Where torch sees no GPU, it says so and exits 0. ``--device cpu --tiny`` runs
every section's code on the CPU (an emulated GPU for the engine, gloo for
FSDP2) with tiny models, in seconds: ``tests/test_gpu_bench.py`` runs it.
``--out PATH`` also writes the table as markdown; ``--timelines DIR`` writes each
engine run's measured and simulated task timelines there (``a_measured.csv.gz``,
...), for reading where the time went after the GPU is given back.

    python bench/gpu.py [--out gpu.md] [--timelines DIR] [--sections abcd]
        [--systems harmony,torch,fsdp2,deepspeed]
    python bench/gpu.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

# cuBLAS needs it set before CUDA starts for deterministic algorithms (section d)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import harmony  # noqa: E402
from harmony import EmulatedDevice, Engine, FlatAdamW, Plan, reference_step  # noqa: E402
from harmony.costs.hardware import format_bytes  # noqa: E402
from harmony.engine import auto_plan as auto_plan_module  # noqa: E402
from harmony.engine import calibrate as calibrate_module  # noqa: E402
from harmony.engine import engine as engine_module  # noqa: E402
from harmony.engine import journal as journal_module  # noqa: E402
from harmony.engine import profiler, rates  # noqa: E402
from harmony.engine.buffers import BufferPool  # noqa: E402
from harmony.engine.calibrate import calibrate  # noqa: E402
from harmony.engine.host_model import HostModel  # noqa: E402
from harmony.engine.journal import UpdateJournal  # noqa: E402
from harmony.engine.rates import (  # noqa: E402
    ADAMW_BYTES_PER_ELEMENT,
    cpu_update_bandwidth,
    matmul_flops,  # noqa: E402
)
from harmony.engine.step import updates as updates_module  # noqa: E402
from harmony.policies import resident  # noqa: E402
from harmony.workbench.baselines import TorchOffload, fastest_microbatch  # noqa: E402
from harmony.workbench.experiments import gpt2_config  # noqa: E402
from harmony.workbench.fsdp_offload import FSDP2Offload, single_process_group  # noqa: E402
from harmony.workbench.training import build_model, lm_loss  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_torch import DeepSpeedOffload  # noqa: E402

GB = 1e9
#: (hidden, blocks, seq, vocab, minibatch) of each section's model; capped memory of (b)
SIZES = {
    "gpu": dict(fits=(1024, 12, 1024, 50257, 8), big=(2048, 24, 1024, 50257, 8), cap=16 * GB),
    "tiny": dict(fits=(32, 2, 16, 64, 4), big=(32, 4, 16, 64, 4), cap=None),
}
#: the systems section (b) measures, by their --systems names
SYSTEMS = ("harmony", "torch", "fsdp2", "deepspeed")
#: seconds each section may take (a, b, c reads what a and b measured, d)
LIMITS = {"a": 150, "b": 360, "d": 60}


@dataclass
class Table:
    """Rows of (section, what, value, note), printed as they come, and the table so
    far written as markdown to ``out`` (if given) at each: a run cut short keeps them."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    out: str | None = None

    def add(self, section: str, what: str, value: str, note: str = "") -> None:
        self.rows.append((section, what, value, note))
        print(f"  [{section}] {what}: {value}" + (f"  ({note})" if note else ""), flush=True)
        if self.out:
            with open(self.out, "w") as f:
                f.write(self.markdown() + "\n")

    def text(self) -> str:
        widths = [max(len(r[i]) for r in self.rows + [HEADER]) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [HEADER, *self.rows]]
        return "\n".join(lines)

    def markdown(self) -> str:
        cells = [HEADER, ("---",) * 4, *self.rows]
        return "\n".join("| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in cells)


HEADER = ("section", "what", "value", "note")


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def section(table: Table, name: str, seconds: int):
    """Run a section: an error or running past ``seconds`` becomes a row, not an abort."""
    started = time.perf_counter()

    def expire(*_):
        raise SectionTimeout(f"past its limit of {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    except Exception as e:  # the table goes on
        traceback.print_exc()
        table.add(
            name, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        table.add(name, "section time", f"{time.perf_counter() - started:.1f} s")
        release()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def uncapped(m: "Machine") -> None:
    """The whole GPU again, after (b) capped it (also where (b) failed half-way)."""
    if m.cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, m.torch_device)


@dataclass
class Machine:
    """Where the sections run: ``torch_device`` for plain PyTorch, ``engine_device``
    for harmony (an emulated GPU in the CPU smoke mode)."""

    torch_device: torch.device
    tiny: bool
    dtype: torch.dtype = torch.bfloat16
    measured: dict = field(default_factory=dict)  # what section c reads (note)
    timelines: str | None = None  # where note writes each run's timelines
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))  # which (b) measures

    @property
    def cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def engine_device(self, capacity: float | None = None):
        if self.cuda:
            return f"cuda:{self.torch_device.index or 0}"
        # links slow enough that a tiny model's swaps cost more than a task does
        return EmulatedDevice(memory=int(capacity or 256e6), h2d="20MB/s", d2h="20MB/s")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.torch_device)

    def timed(self, fn, n: int) -> list[float]:
        out = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    def note(self, key: str, engine: Engine, step: float) -> None:
        """What section c reads of a run (not the engine: its memory is given back)."""
        played = engine.simulate()
        if self.timelines:
            os.makedirs(self.timelines, exist_ok=True)
            for name, trace in (("measured", engine.trace), ("simulated", played)):
                trace.timeline.drop(columns=["layers"], errors="ignore").to_csv(
                    os.path.join(self.timelines, f"{key}_{name}.csv.gz"), index=False
                )
        self.measured[key] = dict(
            step=step,
            simulated=played.summary,
            by_kind=(seconds_by_kind(engine.trace), seconds_by_kind(played)),
            ledger=engine.trace.summary.peak_memory.get("gpu0", 0.0),
            policy=engine.plan.policy,
            torch_peak=self.torch_peak(),
        )

    def torch_peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.torch_device) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.torch_device)


def seconds_by_kind(trace) -> dict[str, float]:
    """Task seconds summed per kind (transfers included) over one step."""
    df = trace.timeline
    return (df["end_s"] - df["start_s"]).groupby(df["kind"]).sum().round(4).to_dict()


def gpt2(sizes: tuple) -> tuple:
    hidden, blocks, seq, vocab, minibatch = sizes
    cfg = gpt2_config(hidden, blocks, seq, vocab)
    model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", minibatch, **cfg)
    return model, x, y, minibatch, seq


def flat_adamw(params):
    return FlatAdamW(params, lr=1e-4)


def gb(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def count(params: int) -> str:
    return (
        f"{params / 1e9:.2f} B"
        if params >= 1e9
        else f"{params / 1e6:.1f} M"
        if params >= 1e6
        else f"{params:,}"
    )


# ---- (a) a model that fits ------------------------------------------------------------
def plain_loop(m: Machine, model, x, y) -> float:
    """Median s/step of the plain loop on the device, fused AdamW there."""
    net = copy.deepcopy(model).to(m.torch_device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=m.cuda)
    xs, ys = x.to(m.torch_device), y.to(m.torch_device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(m.torch_device.type, dtype=m.dtype):
            loss = lm_loss(net(xs), ys)
        loss.backward()
        opt.step()
        return loss.item()

    times = m.timed(step, 3 if m.tiny else 5)
    return statistics.median(times[1:] if m.tiny else times[2:])


#: seconds the last plan="auto" spent in each part of its first step (timed)
SPENT: dict[str, float] = {}
#: the seconds of each of the last plan="auto"'s steps after its first
STEPS: list[float] = []


def timed_part(module, name: str) -> None:
    """``module.name`` (a function) adds its seconds to ``SPENT[name]``."""
    inner = getattr(module, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name] = SPENT.get(name, 0.0) + time.perf_counter() - started

    setattr(module, name, timed)


#: (module, function, label): the parts of plan="auto"'s first step timed, outer
#: before inner; an indented label is a part of the one above it
PARTS = [
    (engine_module, "describe_chain", "describe the chain"),
    (HostModel, "__init__", "host weights laid out (page-locked for a GPU)"),
    (calibrate_module, "_cpu_flops", "calibrate: CPU FLOP rate"),
    (calibrate_module, "task_overhead", "calibrate: cost per task"),
    (calibrate_module, "_cpu_update_bandwidth", "calibrate: host update rate"),
    (profiler, "measure_link", "calibrate: GPU links"),
    (calibrate_module, "_gpu_flops", "calibrate: GPU matmul rate"),
    (rates, "update_bandwidth", "calibrate: GPU update rate"),
    (auto_plan_module, "profile", "profile"),
    (profiler, "_time_layer", "  forward and backward timed"),
    (profiler, "layer_inputs", "  the next layer's inputs"),
    (profiler, "_update_time", "  each layer's update timed"),
    (auto_plan_module, "search", "search"),
    (auto_plan_module, "_first_that_runs", "fit check"),
    (engine_module.Engine, "_place", "place the plan's state"),
    (BufferPool, "take", "buffers taken from pools (made, the first time)"),
]
for _owner, _name, _ in PARTS:
    timed_part(_owner, _name)


def auto_engine(m: Machine, model, x, y, minibatch: int, hardware=None, device=None):
    """``Engine(plan="auto")``: the engine, its first step's seconds (profile, search
    and the step) and the median of three more."""
    SPENT.clear()
    t0 = time.perf_counter()
    engine = Engine(
        copy.deepcopy(model),
        flat_adamw,
        lm_loss,
        device=device or m.engine_device(),
        minibatch_size=minibatch,
        plan="auto",
        precision="bf16",
        hardware=hardware,
    )
    if not m.cuda:  # the smoke run: what a GPU turns on, on the emulated one too
        for switch in SWITCHES["both"]:
            switch(engine, True)
    engine.step(x, y)
    m.sync()
    first = time.perf_counter() - t0
    spent = dict(SPENT)  # the first step's parts, not the later steps'
    m.reset_peak()
    times = m.timed(lambda: engine.step(x, y), 1 if m.tiny else 3)
    SPENT.clear()
    SPENT.update(spent)
    STEPS[:] = times
    return engine, first, statistics.median(times)


def fits(m: Machine, table: Table) -> None:
    model, x, y, minibatch, _ = gpt2(SIZES["tiny" if m.tiny else "gpu"]["fits"])
    params = sum(p.numel() for p in model.parameters())
    table.add("a", "model", f"GPT-2, {count(params)} params, minibatch {minibatch}, bf16")
    plain = plain_loop(m, model, x, y)
    table.add("a", "plain PyTorch step", f"{plain:.4f} s", "fused AdamW on the device")
    release()
    engine, first, step = auto_engine(m, model, x, y, minibatch)
    table.add("a", "harmony plan='auto' step", f"{step:.4f} s", engine.plan.describe())
    table.add("a", "harmony / plain", f"{step / plain:.2f}x", "goal <= 1.10x where it fits")
    table.add("a", "time to first step", f"{first:.1f} s", first_step_parts(first))
    table.add(
        "a",
        "device update rate",
        f"{engine.hardware().gpu_update_bandwidth / GB:.0f} GB/s",
        "calibrated: fused AdamW on the device (on the host's CPU for an emulated GPU); "
        "what the simulator costs the resident update at",
    )
    table.add(
        "a", "the search's fastest", ranked(engine), "simulated s/step, as plan='auto' ranks"
    )
    m.note("a", engine, step)


def first_step_parts(first: float) -> str:
    """The first step's seconds by part (outer parts; the rest is the step itself)."""
    outer = [(name, label) for _, name, label in PARTS if not label.startswith(" ")]
    spent = [(label, SPENT.get(name, 0.0)) for name, label in outer]
    # buffers are taken within the other parts and the step: not subtracted
    rest = first - sum(v for label, v in spent if not label.startswith("buffers"))
    shown = ", ".join(f"{label} {v:.1f} s" for label, v in spent if v >= 0.05)
    return f"{shown}; the rest (the step itself, its buffers included) {rest:.1f} s"


def ranked(engine: Engine, best: int = 3) -> str:
    """The fastest plans of each policy plan='auto' weighs on one GPU, simulated."""
    df = harmony.search(
        engine.profile,
        engine.hardware(),
        engine.minibatch_size,
        policies=("harmony-pp", "resident"),
        n_gpus=1,
        workers=1,
    )
    top = df.groupby("policy", sort=False).head(best)
    return "; ".join(f"{p.describe()} {s:.4f}" for p, s in zip(top["plan"], top["iteration_s"]))


# ---- (b) a model over the capped memory -----------------------------------------------
def floor_s(params: int, tokens: int, hw, peak_flops: float, update_bw: float):
    """The physical floor of one offloaded step and its three terms."""
    compute = 6 * params * tokens / peak_flops
    pcie = max(2 * params / hw.h2d, 2 * params / hw.d2h)  # bf16 weights in, gradients out
    update = params * ADAMW_BYTES_PER_ELEMENT / update_bw
    return max(compute, pcie, update), compute, pcie, update


def capped(m: Machine, cap: float) -> None:
    """A GPU's usable memory capped at ``cap`` (an emulated one is made with it)."""
    if m.cuda:
        total = torch.cuda.get_device_properties(m.torch_device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), m.torch_device)


def big(m: Machine, table: Table) -> None:
    model, x, y, minibatch, seq = gpt2(SIZES["tiny" if m.tiny else "gpu"]["big"])
    params = sum(p.numel() for p in model.parameters())
    # tiny: 3/4 of its footprint (weights, gradients, AdamW's two moments)
    cap = SIZES["tiny" if m.tiny else "gpu"]["cap"] or params * 16 * 3 // 4
    capped(m, cap)
    peak = matmul_flops(m.torch_device, m.dtype, 256 if m.tiny else 8192)
    update_bw = cpu_update_bandwidth()
    device = m.engine_device(cap)
    hw = replace(calibrate(device), gpu_memory=int(0.9 * cap))
    table.add(
        "b",
        "model",
        f"GPT-2, {count(params)} params, minibatch {minibatch}, bf16, memory {gb(cap)}",
        f"matmul peak {peak / 1e12:.2f} TFLOP/s; FlatAdamW {update_bw / GB:.1f} GB/s; "
        f"h2d {hw.h2d / GB:.1f} GB/s",
    )
    big_tensors = cpu_update_bandwidth(1 << (20 if m.tiny else 26))
    table.add(
        "b",
        "host update rate",
        f"FlatAdamW {update_bw / GB:.1f} GB/s on 4 M elements, {big_tensors / GB:.1f} on "
        f"{'1 M' if m.tiny else '64 M'}",
        f"torch threads {torch.get_num_threads()}; the floor takes the first",
    )
    tokens = minibatch * seq
    floor, compute, pcie, update = floor_s(params, tokens, hw, peak, update_bw)
    table.add(
        "b",
        "physical floor",
        f"{floor:.3f} s/step",
        f"max(compute {compute:.3f}, PCIe {pcie:.3f}, CPU update {update:.3f})",
    )
    for system in offload_systems(m, model, minibatch, device):
        name = system[0]
        if name.startswith("DeepSpeed") and importlib.util.find_spec("deepspeed") is None:
            table.add("b", name, "not installed")
            continue
        try:
            seconds, note = measure(m, system, x, y, hw, model, minibatch)
        except Exception as e:  # one system failing is a result; the others still run
            traceback.print_exc()
            table.add("b", name, "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        finally:
            release()
        if seconds is None:
            table.add("b", name, "out of memory at every microbatch size")
            continue
        mfu = 6 * params * tokens / seconds / peak
        table.add(
            "b",
            name,
            f"{minibatch / seconds:.2f} samples/s",
            f"{seconds:.3f} s/step, MFU {mfu:.1%}, {seconds / floor:.2f}x the floor; {note}",
        )


#: what a GPU turns on, switched off in turn and together by :func:`switched_off`
SWITCHES = {
    "none": [],
    "casts kept": [lambda e, on: setattr(e, "keep_casts", on)],
    "journal ahead": [lambda e, on: setattr(e.journal, "ahead", on)],
}
SWITCHES["both"] = SWITCHES["casts kept"] + SWITCHES["journal ahead"]


def switched_off(m: Machine, engine: Engine, x, y) -> str:
    """The same engine's median s/step with nothing, then each of ``SWITCHES``, switched
    off: rounds of one step of each, interleaved (a step's time spreads ±15% on a GPU
    whose host also updates); and what its journal did in those steps."""
    times: dict[str, list[float]] = {what: [] for what in SWITCHES}
    with JournalCounts() as journal:
        for _ in range(1 if m.tiny else 5):
            for what, off in SWITCHES.items():
                for switch in off:
                    switch(engine, False)
                times[what] += m.timed(lambda: engine.step(x, y), 1)
                for switch in off:
                    switch(engine, True)
    medians = ", ".join(f"{what} {statistics.median(t):.3f}" for what, t in times.items())
    return f"s/step with off: {medians}; {journal}"


class JournalCounts:
    """Counts, while in the block, the updates journaled (their copies made ahead, or at
    the update) and those not (past the point of no return)."""

    def __enter__(self):
        self.counts = {"ahead": 0, "at the update": 0, "not journaled": 0}
        record, self._record = UpdateJournal.record, UpdateJournal.record
        apply, self._apply = journal_module.apply_update, journal_module.apply_update
        counts = self.counts

        def counted_record(journal, key, *args, **kwargs):
            counts["ahead" if key in journal._ahead else "at the update"] += 1
            return record(journal, key, *args, **kwargs)

        def counted_apply(opt, layers, key, journal, *args, **kwargs):
            counts["not journaled"] += journal is None
            return apply(opt, layers, key, journal, *args, **kwargs)

        UpdateJournal.record = counted_record
        journal_module.apply_update = counted_apply
        updates_module.apply_update = counted_apply
        return self

    def __exit__(self, *exc):
        UpdateJournal.record = self._record
        journal_module.apply_update = self._apply
        updates_module.apply_update = self._apply

    def __str__(self) -> str:
        return "updates: " + ", ".join(f"{k} {v}" for k, v in self.counts.items())


def offload_systems(m: Machine, model, minibatch: int, device) -> list:
    """(name, make(u) or None for harmony, microbatch sizes to try, needs a process group)."""
    sizes = [u for u in (4, 2, 1) if u <= minibatch and minibatch % u == 0]
    if m.tiny:
        sizes = [minibatch // 2]
    systems = [
        ("harmony plan='auto'", None, [minibatch], False),
        (
            "torch offload (TorchOffload)",
            lambda u: TorchOffload(
                copy.deepcopy(model), flat_adamw, lm_loss, device, u, autocast=m.dtype
            ),
            sizes,
            False,
        ),
        (
            "FSDP2 + CPUOffloadPolicy",
            lambda u: FSDP2Offload(copy.deepcopy(model), lm_loss, u, m.dtype, m.torch_device),
            sizes,
            True,
        ),
        (
            "DeepSpeed ZeRO-Offload",
            lambda u: DeepSpeedOffload(copy.deepcopy(model), lm_loss, u, minibatch, m.dtype),
            sizes,
            True,
        ),
    ]
    return [s for s, key in zip(systems, SYSTEMS) if key in m.systems]


def measure(m: Machine, system, x, y, hw, model, minibatch) -> tuple[float | None, str]:
    """Median s/step of a system (its microbatch size tuned: the fastest that fits)."""
    _, make, sizes, group = system
    if make is None:
        device = m.engine_device(hw.gpu_memory / 0.9)
        engine, first, step = auto_engine(m, model, x, y, minibatch, hw, device)
        steps = ", ".join(f"{s:.3f}" for s in STEPS)
        m.note("b", engine, step)
        return (
            step,
            f"{engine.plan.describe()}; steps {steps} s; {switched_off(m, engine, x, y)}; "
            f"first step {first:.1f} s: {first_step_parts(first)}",
        )
    log: list[str] = []
    with single_process_group(m.torch_device) if group else contextlib.nullcontext():
        u = sizes[0]
        if len(sizes) > 1:
            u = fastest_microbatch(
                lambda u: m.timed(lambda: make(u).step(x, y), 1)[0], sizes, log=log.append
            )
        if u is None:
            return None, "; ".join(log)
        runner = make(u)
        m.reset_peak()
        times = m.timed(lambda: runner.step(x, y), 2 if m.tiny else 3)
    return statistics.median(times[1:]), f"microbatch {u}, peak {gb(m.torch_peak())}"


# ---- (c) the simulator against the runs ---------------------------------------------
def simulated(m: Machine, table: Table) -> None:
    for key in ("a", "b"):
        if key not in m.measured:
            table.add("c", f"run of ({key})", "none", "its section did not finish")
            continue
        run = m.measured[key]
        step, sim = run["step"], run["simulated"]
        table.add(
            "c",
            f"({key}) measured / simulated step",
            f"{step / sim.iteration_s:.2f}",
            f"{step:.4f} s measured, {sim.iteration_s:.4f} s simulated, {run['policy']}",
        )
        table.add(
            "c",
            f"({key}) peak memory",
            f"ledger {gb(run['ledger'])}",
            f"simulated {gb(sim.peak_memory.get('gpu0'))}, torch.cuda.max_memory_allocated "
            f"{gb(run['torch_peak'])}",
        )
        measured, sim = run["by_kind"]
        table.add(
            "c",
            f"({key}) task seconds by kind",
            ", ".join(f"{k} {v:.3f}" for k, v in sorted(measured.items())),
            "simulated: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(sim.items())),
        )


# ---- (d) exactness --------------------------------------------------------------------
def exactness(m: Machine, table: Table) -> None:
    """The engine against reference_step on the same device, float32, deterministic."""
    torch.use_deterministic_algorithms(True)
    try:
        model, x, y, minibatch, _ = gpt2((32, 2, 16, 64, 8) if m.tiny else (64, 2, 32, 128, 8))
        n = len(harmony.decompose(model))
        plans = {
            "harmony-pp, 2 packs": Plan(
                "harmony-pp", 1, minibatch, 4, 4, ((0, 2),), ((0, 2), (2, n))
            ),
            "resident": resident.plan_for(n, minibatch, 4),
        }
        expected = reference_weights(m, model, x, y)
        for name, plan in plans.items():
            got = engine_weights(m, model, x, y, plan, "fp32")
            table.add("d", name, same(got, expected), "vs reference_step, 2 AdamW steps, fp32")
        # bf16: weights cast on the host and staged (harmony-pp) or cast on the GPU (resident),
        # gradients cast on the GPU (harmony-pp) or summed there (resident): the same rounding
        one = Plan("harmony-pp", 1, minibatch, 4, 4, (), ((0, n),))
        staged = engine_weights(m, model, x, y, one, "bf16")
        on_gpu = engine_weights(m, model, x, y, plans["resident"], "bf16")
        table.add("d", "bf16: one-pack harmony-pp vs resident", same(staged, on_gpu), "2 steps")
        # what a GPU turns on (emulated devices do not, unless asked): the same bits either way
        two = plans["harmony-pp, 2 packs"]
        for what, switch in (
            ("bf16: weight casts kept for the backward's load", SWITCHES["casts kept"][0]),
            ("bf16: the journal's copies made during the forward", SWITCHES["journal ahead"][0]),
        ):
            on, off = (
                engine_weights(m, model, x, y, two, "bf16", lambda e, v=v: switch(e, v))
                for v in (True, False)
            )
            table.add("d", what, same(on, off), "on vs off, 2 steps")
    finally:
        torch.use_deterministic_algorithms(False)


def engine_weights(
    m: Machine, model, x, y, plan: Plan, precision: str, setup=None
) -> list[torch.Tensor]:
    """The weights after 2 steps (``setup``: called with the engine before them)."""
    engine = Engine(
        copy.deepcopy(model),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lm_loss,
        device=m.engine_device(),
        minibatch_size=y.shape[0],
        plan=plan,
        precision=precision,
    )
    if setup is not None:
        setup(engine)
    for _ in range(2):
        engine.step(x, y)
    return [p.detach().cpu() for p in engine.model.parameters()]


def same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    if all(torch.equal(a, b) for a, b in zip(got, expected)):
        return "bitwise"
    return f"max |diff| {max((a - b).abs().max().item() for a, b in zip(got, expected)):.2e}"


def reference_weights(m: Machine, model, x, y) -> list[torch.Tensor]:
    net = copy.deepcopy(model).to(m.torch_device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    xs, ys = x.to(m.torch_device), y.to(m.torch_device)
    for step in range(2):
        reference_step(list(net), lm_loss, opt, (xs,), ys, 4, step)
    return [p.detach().cpu() for p in net.parameters()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models (the CPU smoke run)")
    ap.add_argument("--out", help="also write the table as markdown to this file")
    ap.add_argument("--timelines", help="write each engine run's timelines to this folder")
    ap.add_argument(
        "--sections", default="abcd", help="which sections to run, e.g. 'b' (default: abcd)"
    )
    ap.add_argument(
        "--systems",
        default="harmony,torch,fsdp2,deepspeed",
        help="which systems (b) measures, comma-separated (default: all four)",
    )
    args = ap.parse_args()
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown or set(args.sections) - set("abcd"):
        ap.error(f"--sections takes letters of abcd; --systems names of {', '.join(SYSTEMS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: torch sees no GPU (torch.cuda.is_available() is False); nothing run")
        return 0
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    m = Machine(device, args.tiny, timelines=args.timelines, systems=args.systems.split(","))
    table = Table(out=args.out)
    name = torch.cuda.get_device_name(device) if m.cuda else "CPU (emulated GPU for the engine)"
    print(f"{name}, torch {torch.__version__}", flush=True)
    table.add("-", "device", name, f"torch {torch.__version__}")
    started = time.perf_counter()
    if "a" in args.sections:
        with section(table, "a", LIMITS["a"]):
            fits(m, table)
    if "b" in args.sections:
        with section(table, "b", LIMITS["b"]):
            try:
                big(m, table)
            finally:
                uncapped(m)
    if "c" in args.sections:
        with section(table, "c", 60):
            simulated(m, table)
    if "d" in args.sections:
        with section(table, "d", LIMITS["d"]):
            exactness(m, table)
    table.add("-", "total", f"{time.perf_counter() - started:.1f} s")
    print("\n" + table.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
