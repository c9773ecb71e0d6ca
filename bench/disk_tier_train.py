"""The engine training with a disk tier: measured seconds per step against the
simulator and the lower bound, disk bytes against the closed form.

**Emulated** (default): a GPT-2-style model on an emulated GPU, a host memory
budget that sends every pack's AdamW state to disk (``--weights`` also the
master weights) and an emulated disk link paced to ``--disk`` (200 MB/s each
way), so the disk dominates the step. The model is profiled on this CPU first,
so the simulator plays the engine's graph with measured compute and update
times. Printed: the placement, measured s/step (median over the steps after
the first, which reads no optimizer state yet) against the simulated
iteration and the lower bound (disk bytes over bandwidth against compute),
and per disk kind measured / simulated / closed-form bytes.
``--stashes``: a budget that sends the stashes to disk too (with ``--minibatch``
and ``--seq`` large enough for them to matter).
``--weights-apart``: every weight load reads the master weights on disk for
itself (``harmony.policies.without_weights_with_update``), where by default a
pack's backward load takes them from its update's read (Harmony's pipeline).
``--gradients both`` trains twice under the same budget: the gradients in two
pack slots (Harmony's policies, where the whole model's do not fit) and the
whole model's (``harmony.policies.without_gradient_slots``), and prints what
each put on disk and their s/step side by side.

**Real** (``--real``): a GPT-2-style model of ``--blocks`` blocks of width
``--hidden`` (29 x 2560: fp32 weights, gradients and AdamW state 1.6x a
25 GB machine's RAM), built under ``harmony.empty_weights()`` (its weights made
by the engine where they live, never all in RAM), trained for a few steps on the CPU (the ``cpu``
backend: no device copies) with a host budget under RAM (``--host-memory``,
the whole process's) over the real disk in ``--dir``, measured there first.
Printed: the state's size against RAM and the budget, the placement, peak
resident memory of the process (the kernel's ``VmHWM``) against the budget,
s/step against the simulator (with the measured disk bandwidth) and the
lower bound. The tier's files are deleted at the end.

    python bench/disk_tier_train.py [--steps 4] [--disk 200MB/s,200MB/s] [--weights] [--auto]
        [--gradients slots|whole|both] [--weights-apart] [--stashes --minibatch 16 --seq 512]
    python bench/disk_tier_train.py --real --dir /var/tmp [--hidden 2560] [--steps 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW, Plan, empty_weights
from harmony.costs.hardware import format_bytes, parse_bytes
from harmony.costs.zoo.modules import init_transformer
from harmony.engine.calibrate import calibrate
from harmony.engine.devices import make_backends
from harmony.engine.host_memory import (
    available_host_bytes,
    device_memory_in_host,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)
from harmony.engine.host_pages import return_freed_memory
from harmony.engine.profiler import profile
from harmony.engine.tiers import measure_disk_bandwidth
from harmony.graph import DISK_IN, DISK_OUT
from harmony.policies import (
    build_graph,
    swap_volume,
    without_gradient_slots,
    without_weights_with_update,
)
from harmony.policies.disk_tier import stashes_in_flight, windowed_gradients
from harmony.policies.state import host_state
from harmony.workbench.training import build_model, lm_loss

OPT = lambda ps: FlatAdamW(ps, lr=1e-4)  # noqa: E731


def gpt2(hidden: int, blocks: int, seq: int, vocab: int, minibatch: int):
    cfg = dict(hidden=hidden, n_layer=blocks, heads=max(1, hidden // 64), seq_len=seq)
    cfg.update(max_position=seq, vocab=vocab)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", minibatch, **cfg)
    return cfg, x, y


def one_pack_per_layer(n_layers: int, minibatch: int, microbatch: int) -> Plan:
    """Harmony-PP with every layer a pack: the smallest staging (three packs)."""
    packs = tuple((i, i + 1) for i in range(n_layers))
    return Plan("harmony-pp", 1, minibatch, microbatch, microbatch, packs[:-1], packs)


def budget_for(spec, plan: Plan, weights_too: bool, stashes_too: bool = False) -> int:
    """Host memory that sends every pack's optimizer state to disk (and, with
    ``weights_too``, half of the master weights): gradients (in two pack slots),
    the master weights left and the update journal's copy of them, stashes (with
    ``stashes_too``, only those in flight to and from disk), three packs of
    staging and room for the tier's buffers."""
    state = [host_state(spec, range(*p)) for p in plan.bwd_packs]
    moved = swap_volume(spec, plan)
    stash = moved.get("STASH_OUT", 0.0) + moved.get("ACT_OUT", 0.0)
    if stashes_too:
        stash = stashes_in_flight(spec, plan)
    weights = sum(s.weights for s in state) // (2 if weights_too else 1)
    staging = 3 * max(s.optimizer + (s.weights if weights_too else 0) for s in state)
    need = windowed_gradients(spec, plan) + 2 * weights + stash + staging
    return int(need * 1.03)  # the tier's I/O buffers and file padding


def outside(spec, plan: Plan, device: EmulatedDevice) -> int:
    """What the engine's host budget must hold besides the state: this process as
    it is now (the profiled copy of the model freed and trimmed), with room for
    what setting up a step adds (torch's lazily made buffers, ~35 MB), and the
    emulated GPU's memory, which is host memory."""
    graph = build_graph(spec, device.hardware(), plan)
    return resident_bytes() + SET_UP + device_memory_in_host(make_backends(device), graph)


SET_UP = 48 * 2**20


def report(engine: Engine, times: list[float], lower: float) -> None:
    trace, sim = engine.trace.summary, engine.simulate().summary
    closed = swap_volume(engine.spec, engine.plan, engine.hardware())
    it = statistics.median(times[1:])
    placement = engine.disk.placement
    kinds = sorted({k for _, k in placement.on_disk})
    held = engine.gradient_slots
    stashes = (
        f"; the stashes too, {format_bytes(placement.stash_disk_bytes)} per step"
        if placement.stashes_on_disk
        else ""
    )
    print(
        f"placement: {', '.join(kinds)} of {len({q for q, _ in placement.on_disk})} packs on "
        f"disk, {format_bytes(placement.disk_bytes)} (x2 slots on disk){stashes}; host state "
        f"{format_bytes(placement.host_state_bytes)}, staging "
        f"{format_bytes(placement.staging_bytes)}; gradients "
        + (f"in {placement.gradient_slots} pack slots" if held else "of the whole model")
        + f" (with stashes {format_bytes(placement.reserve)})"
    )
    print(
        f"measured {it:.3f} s/step (median of steps 2..{len(times)}: "
        f"{', '.join(f'{t:.3f}' for t in times)}), simulated {sim.iteration_s:.3f} s: "
        f"measured / simulated {it / sim.iteration_s:.3f}"
    )
    print(
        f"lower bound {lower:.3f} s (disk bytes / bandwidth vs compute); measured / bound "
        f"{it / lower:.3f}; simulated / bound {sim.iteration_s / lower:.3f}"
    )
    busy = [(k, _busy(engine.trace, k), _busy(engine.simulate(), k)) for k in BUSY]
    print(
        "  busy s, measured / simulated: " + ", ".join(f"{k} {m:.2f}/{s:.2f}" for k, m, s in busy)
    )
    for kind in (DISK_IN, DISK_OUT):
        print(
            f"  {kind}: measured {format_bytes(trace.bytes_by_kind[kind])}, simulated "
            f"{format_bytes(sim.bytes_by_kind[kind])}, closed form {format_bytes(closed[kind])}"
        )


BUSY = ("FWD", "REC", "BWD", "FWDBWD", "UPD", "W_IN", "G_OUT", DISK_IN, DISK_OUT)


def _busy(trace, kind: str) -> float:
    tl = trace.timeline
    return float((tl.end_s - tl.start_s)[tl.kind == kind].sum())


def lower_bound(engine: Engine) -> float:
    """The disk's seconds per step (each direction at its bandwidth: the two
    overlapping, or one after the other where they share the disk's time)
    against the compute lane's busy time in the simulator's play."""
    sim = engine.simulate()
    bytes_ = sim.summary.bytes_by_kind
    disk = engine.hardware().disk_seconds(bytes_[DISK_IN], bytes_[DISK_OUT])
    tl = sim.timeline
    compute = (tl.end_s - tl.start_s)[tl.kind.isin(["FWD", "BWD", "FWDBWD", "REC"])].sum()
    return max(disk, compute)


def emulated(args) -> None:
    torch.set_num_threads(1)
    cfg, x, y = gpt2(args.hidden, args.blocks, args.seq or 64, 512, args.minibatch)
    layers = list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg))
    spec = profile(layers, (x,), y, lm_loss, OPT, name="gpt2-disk-bench")
    params = sum(p.numel() for m in layers for p in m.parameters())
    del layers  # the profiled copy: not part of what the budget holds besides the model
    gc.collect()
    return_freed_memory()
    plan = one_pack_per_layer(len(spec), args.minibatch, args.minibatch // 2)
    device = EmulatedDevice(memory="512MB", h2d="2GB/s", d2h="2GB/s")
    # the engine measures the process besides the model at its first step, when
    # transient allocations (graphs played, glibc's arenas) move it by up to ~180 MB from
    # run to run: pin it at what was measured here, so that the placement is the one this
    # budget asks for (the real mode is where the process's resident memory is checked)
    import harmony.engine.engine as engine_module

    besides = resident_bytes() + SET_UP
    engine_module.besides_the_model = lambda module: besides
    if args.host_memory:
        host = parse_bytes(args.host_memory, "--host-memory")
    else:
        host = budget_for(spec, plan, args.weights, args.stashes) + outside(spec, plan, device)
    print(
        f"GPT-2-style, {args.blocks} blocks of width {args.hidden}: "
        f"{params / 1e6:.1f} M parameters; "
        f"host budget {format_bytes(host)}; emulated disk {args.disk}"
    )
    if args.gradients == "both":  # each in a fresh process, under this budget
        both(host)
        return
    variant = without_gradient_slots if args.gradients == "whole" else contextlib.nullcontext
    with variant():
        train_emulated(args, cfg, spec, plan, device, host, x, y)


def both(host: int) -> None:
    """The bench once with the gradients in slots and once with the whole model's,
    each in a process of its own (what one leaves resident would count against the
    other's budget), under the same host budget; then their s/step side by side."""
    argv = [a for a in sys.argv[1:] if a not in ("--gradients", "both")]
    steps = {}
    for name in ("slots", "whole"):
        print(f"\n-- gradients: {name}", flush=True)
        cmd = [sys.executable, __file__, *argv, "--gradients", name, "--host-memory", str(host)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        print(out.stdout + out.stderr[-2000:], end="", flush=True)
        found = re.search(r"measured ([0-9.]+) s/step", out.stdout)
        steps[name] = float(found.group(1)) if found else None
    if None not in steps.values():
        ratio = steps["slots"] / steps["whole"]
        print(f"\ns/step with gradient slots / with the whole model's: {ratio:.3f}")


def train_emulated(args, cfg, spec, plan, device, host, x, y) -> float:
    """Train ``args.steps`` steps and print the report."""
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        engine = Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            OPT,
            lm_loss,
            device=device,
            minibatch_size=args.minibatch,
            plan="auto" if args.auto else plan,
            spec=spec,
            host_memory=host,
            disk_dir=Path(tmp) / "tier",
            disk=args.disk,
        )
        try:
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step(x, y)
                times.append(time.perf_counter() - started)
            if args.auto:
                print(f"plan='auto' picked {engine.plan.describe()}")
            report(engine, times, lower_bound(engine))
        finally:
            engine.close()


def real(args) -> None:
    ram = available_host_bytes() or 0
    total = _meminfo_total()
    directory = Path(args.dir)
    bw = measure_disk_bandwidth(directory, "1GB")
    print(f"machine: RAM {format_bytes(total)} ({format_bytes(ram)} available); disk {bw}")
    cfg, x, y = gpt2(args.hidden, args.blocks, args.seq or 128, args.vocab, 1)
    base = peak_resident_bytes()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        started = time.perf_counter()
        with empty_weights():  # the engine makes the weights where they live
            model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
        params = sum(p.numel() for p in model.parameters())
        state = 16 * params
        print(
            f"GPT-2-style, {args.blocks} blocks of width {args.hidden}, vocab {args.vocab} "
            f"(built in {time.perf_counter() - started:.0f} s): {params / 1e9:.2f} B "
            f"parameters; fp32 weights + gradients + AdamW state {format_bytes(state)} = "
            f"{state / total:.2f}x RAM; host budget {args.host_memory}",
            flush=True,
        )
        plan = one_pack_per_layer(len(model), 1, 1)
        spec = None
        if args.profile:  # measured compute and update times for the simulator
            started = time.perf_counter()
            spec = profile(list(model), (x,), y, lm_loss, OPT, name="gpt2-real", repeats=1)
            print(f"profiled in {time.perf_counter() - started:.0f} s", flush=True)
        # the cpu backend computes on host memory: a weight load of master weights read
        # from disk copies them there, so its "device" memory is bounded like a GPU's
        hardware = replace(calibrate("cpu"), gpu_memory=parse_bytes(args.device_memory))
        engine = Engine(
            model,
            OPT,
            lm_loss,
            device="cpu",
            hardware=hardware,
            minibatch_size=1,
            plan=plan,
            spec=spec,
            host_memory=args.host_memory,
            disk_dir=Path(tmp) / "tier",
            disk=(bw.read, bw.write, bw.shared) if args.pace else None,
            init=init_transformer,  # GPT-2's N(0, 0.02)
        )
        del model
        try:
            times = []
            for step in range(args.steps):
                started = time.perf_counter()
                engine.step(x, y)
                times.append(time.perf_counter() - started)
                print(f"step {step}: {times[-1]:.1f} s", flush=True)
                if step == 0:  # with making the weights and writing the tier's share
                    setup_peak = peak_resident_bytes()
                    reset = reset_peak_resident()
            peak = peak_resident_bytes()
            device = engine.trace.summary.peak_memory["gpu0"]
            budget = engine.host_settings.budget
            outside = ", ".join(
                f"{k} {format_bytes(v)}" for k, v in engine.host_settings.outside.items()
            )
            print(
                f"peak resident memory through building the model and step 0 (making its "
                f"weights, the tier's share written as made) {format_bytes(setup_peak)}; "
                + (
                    f"in steps 1..{args.steps - 1} {format_bytes(peak)}"
                    if reset and args.steps > 1
                    else "(the peak could not be reset)"
                )
                + f" against the host budget {format_bytes(budget.capacity)} (under: "
                f"{peak <= budget.capacity}); the "
                f"budget's ledger peaked at {format_bytes(budget.peak)}, of which {outside}; "
                f"the cpu backend's device memory {args.device_memory} (simulated peak "
                f"{format_bytes(device)}: weight copies, gradients, activations); the process "
                f"before the model {format_bytes(base)}"
            )
            if args.auto:
                print(f"plan='auto' picked {engine.plan.describe()}")
            report(engine, times, lower_bound(engine))
        finally:
            engine.close()
            shutil.rmtree(Path(tmp) / "tier", ignore_errors=True)


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the tier's directory goes")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=2)
    ap.add_argument("--disk", default="200MB/s,200MB/s", help="the emulated disk link")
    ap.add_argument("--host-memory", default=None, help="default: all optimizer state on disk")
    ap.add_argument("--weights", action="store_true", help="master weights on disk too")
    ap.add_argument(
        "--auto", action="store_true", help="plan='auto' under the same budget (searched)"
    )
    ap.add_argument(
        "--gradients",
        choices=("slots", "whole", "both"),
        default="slots",
        help="host gradients in two pack slots, the whole model's, or both side by side",
    )
    ap.add_argument("--real", action="store_true", help="a model larger than RAM, real disk")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (64; --real: 128)")
    ap.add_argument("--stashes", action="store_true", help="the stashes on disk too")
    ap.add_argument("--vocab", type=int, default=50257, help="--real: GPT-2's")
    ap.add_argument("--pace", action="store_true", help="--real: pace to the measured disk")
    ap.add_argument("--profile", action="store_true", help="--real: measure compute times")
    ap.add_argument("--device-memory", default="2GB", help="--real: the cpu backend's")
    ap.add_argument(
        "--weights-apart",
        action="store_true",
        help="every weight load reads master weights on disk for itself (none shares its "
        "pack's update's read)",
    )
    args = ap.parse_args()
    apart = without_weights_with_update if args.weights_apart else contextlib.nullcontext
    with apart():
        real(args) if args.real else emulated(args)


if __name__ == "__main__":
    main()
