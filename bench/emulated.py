"""The engine on an emulated GPU much smaller than the model's training footprint.

A GPT-2-style model is profiled on this CPU; the emulated link is paced so that
compute : bandwidth matches a GTX 1080 Ti on PCIe 3.0 (~11 TFLOP/s : ~12 GB/s,
about 1000 FLOP per byte), i.e. the link is as many times slower than PCIe as
this CPU is slower than the GPU. The planner picks the best Harmony plan and
the best virtualized-memory plan on the measured profile; the same engine runs
both. Printed, measured side by side in one run (medians over steps):

* measured iteration time / its lower bound (goal <= 1.10);
* measured / simulated iteration time on the measured profile (goal within 10%);
* measured / simulated peak device memory (goal within 5%);
* measured bytes / closed-form swap volume, per kind (goal 1.00);
* Harmony vs the harmony-no-grouping baseline: speedup and swap-volume ratio;
* the update time left exposed after the last compute task (end of the last
  UPD minus end of the last FWD/BWD, over the iteration) of the Harmony plan,
  with torch.optim.AdamW and with harmony's FlatAdamW (goal <= 5%), and the
  part of it after the last gradient landed on the host (the rest is that
  gradient's transfer).

    python bench/emulated.py [--steps 4] [--hidden 256] [--blocks 6] [--memory 24MB]
"""

import argparse
import statistics
import time

import torch

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW
from harmony.engine.calibrate import calibrate
from harmony.engine.profiler import FLOP_PER_BYTE_1080TI, cpu_flops, profile
from harmony.planner.search import search
from harmony.workbench.training import build_model, lm_loss


def exposed_update(trace: harmony.Trace) -> tuple[float, float]:
    """Time from the end of the last forward/backward task, and from the last
    gradient's arrival on the host, to the end of the last CPU update, as
    fractions of the iteration: what the overlap of updates with backward left."""
    tl = trace.timeline
    last_compute = tl[tl.kind.isin(["FWD", "BWD", "FWDBWD"])].end_s.max()
    last_grad = max(last_compute, tl[tl.kind == "G_OUT"].end_s.max())
    last_update = tl[tl.kind == "UPD"].end_s.max()
    return (
        max(0.0, last_update - last_compute) / trace.iteration_s,
        max(0.0, last_update - last_grad) / trace.iteration_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--memory", default="24MB")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dict(
        hidden=args.hidden, n_layer=args.blocks, heads=4, seq_len=64, max_position=64, vocab=512
    )
    layers = list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg))
    (x,), y = harmony.zoo.example_input("gpt2-tiny", args.minibatch, **cfg)
    loss = lm_loss
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731

    flops = cpu_flops()
    rate = flops / FLOP_PER_BYTE_1080TI
    device = EmulatedDevice(memory=args.memory, h2d=rate, d2h=rate)
    spec = profile(layers, (x,), y, loss, opt, name="gpt2-bench")
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    activations = sum(c.bwd_extra(args.minibatch) for c in spec.layers)
    footprint = (
        params * 4 * 4 + activations
    )  # weights, gradients, two AdamW states, saved activations
    print(
        f"CPU {flops / 1e9:.1f} GFLOP/s (1 thread) -> emulated link {rate / 1e6:.1f} MB/s per "
        f"direction; device {device.capacity / 1e6:.1f} MB; model {params:,} params, training "
        f"footprint {footprint / 1e6:.1f} MB = {footprint / device.capacity:.1f}x the device"
    )

    hw = calibrate(device)
    print(f"engine cost per compute task on this device: {hw.task_overhead_s * 1e3:.2f} ms")
    plans = {}
    for policy in ("harmony-pp", "harmony-no-grouping"):
        df = search(spec, hw, args.minibatch, policies=(policy,), n_gpus=1, workers=1)
        plans[policy] = df.iloc[0]["plan"]
        print(f"{policy}: {plans[policy].describe()}  (simulated {df.iloc[0].iteration_s:.3f} s)")

    results = {}
    for policy, plan in plans.items():
        model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
        engine = Engine(
            model, opt, loss, device=device, minibatch_size=args.minibatch, plan=plan, spec=spec
        )
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step(x, y)
            times.append(time.perf_counter() - t0)
        measured = engine.trace.summary
        sim = harmony.simulate(spec, hw, plan).summary
        volume = harmony.swap_volume(spec, plan)
        results[policy] = (statistics.median(times[1:]), measured, sim, volume)
        it = statistics.median(times[1:])
        print(
            f"\n{policy}: measured {it:.3f} s/step (median of {args.steps - 1}), "
            f"simulated {sim.iteration_s:.3f} s"
        )
        print(
            f"  measured / lower bound       {measured.iteration_s / measured.lower_bound_s:.3f}"
            f"  (bound {measured.lower_bound_s:.3f} s, {measured.lower_bound_by})"
        )
        print(f"  measured / simulated time    {it / sim.iteration_s:.3f}")
        print(
            "  measured / simulated peak    "
            f"{measured.peak_memory['gpu0'] / sim.peak_memory['gpu0']:.3f}  "
            f"({measured.peak_memory['gpu0'] / 1e6:.2f} MB vs {sim.peak_memory['gpu0'] / 1e6:.2f} "
            f"MB, capacity {device.capacity / 1e6:.1f} MB)"
        )
        kinds = sorted(k for k, v in volume.items() if v)
        print(
            "  measured / closed-form bytes "
            + ", ".join(f"{k} {measured.bytes_by_kind.get(k, 0.0) / volume[k]:.3f}" for k in kinds)
        )
    (t_h, m_h, *_), (t_v, m_v, *_) = results["harmony-pp"], results["harmony-no-grouping"]
    print(
        f"\nHarmony vs virtual memory on the same engine: speedup {t_v / t_h:.2f}x, "
        f"swap volume {m_v.swap_bytes / m_h.swap_bytes:.2f}x less"
    )

    print(
        "\nharmony-pp: update time exposed after the last compute task (goal <= 5% of the "
        f"iteration), median of {args.steps - 1} steps"
    )
    engines = {
        name: Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            make,
            loss,
            device=device,
            minibatch_size=args.minibatch,
            plan=plans["harmony-pp"],
            spec=spec,
        )
        for name, make in (
            ("torch AdamW", opt),
            ("harmony FlatAdamW", lambda ps: FlatAdamW(ps, lr=1e-4)),
        )
    }
    exposed, updates = {name: [] for name in engines}, {name: [] for name in engines}
    for _ in range(args.steps):  # interleaved: drift in the machine's load hits both alike
        for name, engine in engines.items():
            engine.step(x, y)
            upd = engine.trace.timeline.query("kind == 'UPD'")
            exposed[name].append(exposed_update(engine.trace))
            updates[name].append((upd.end_s - upd.start_s).sum())
    for name in engines:
        after_compute, after_grad = (
            statistics.median(e[k] for e in exposed[name][1:]) for k in (0, 1)
        )
        print(
            f"  {name:18s} exposed {100 * after_compute:5.2f}% of the iteration "
            f"({100 * after_grad:.2f}% after the last gradient landed); all updates "
            f"{1e3 * statistics.median(updates[name][1:]):.1f} ms per step"
        )

    precision(args, cfg, device, hw, spec, plans["harmony-pp"], x, y)


def precision(args, cfg, device, hw, spec, plan, x, y) -> None:
    """The Harmony plan in float32 and in bfloat16 (mixed precision), interleaved:
    bytes moved per kind and iteration time, measured and simulated (each on
    its own profile)."""
    print(f"\nharmony-pp in fp32 and bf16 (the same plan), median of {args.steps - 1} steps")
    fp32, bf16 = cpu_flops(n=256), cpu_flops(torch.bfloat16, n=256)
    if bf16 < fp32 / 4:
        print(
            f"  skipped: this CPU computes bf16 matmuls at {bf16 / 1e9:.1f} GFLOP/s against "
            f"{fp32 / 1e9:.1f} in fp32 (no native bf16), so a bf16 step would take minutes and "
            "measure only that"
        )
        return
    layers = list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg))
    specs = {
        "fp32": spec,
        "bf16": profile(
            layers,
            (x,),
            y,
            lm_loss,
            lambda ps: FlatAdamW(ps, lr=1e-4),
            name="gpt2-bench",
            dtype=torch.bfloat16,
        ),
    }
    engines = {
        p: Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            lambda ps: FlatAdamW(ps, lr=1e-4),
            lm_loss,
            device=device,
            minibatch_size=args.minibatch,
            plan=plan,
            precision=p,
            spec=specs[p],
        )
        for p in ("fp32", "bf16")
    }
    times = {p: [] for p in engines}
    for _ in range(args.steps):
        for p, engine in engines.items():
            t0 = time.perf_counter()
            engine.step(x, y)
            times[p].append(time.perf_counter() - t0)
    moved = {p: e.trace.summary.bytes_by_kind for p, e in engines.items()}
    for p, engine in engines.items():
        sim = harmony.simulate(specs[p], hw, plan).summary.iteration_s
        print(
            f"  {p}: measured {statistics.median(times[p][1:]):.3f} s/step, simulated {sim:.3f} s "
            f"(its own profile), bytes moved {engine.trace.summary.swap_bytes / 1e6:.1f} MB"
        )
    print(
        "  fp32 / bf16 bytes: "
        + ", ".join(
            f"{k} {v / moved['bf16'][k]:.2f}"
            for k, v in moved["fp32"].items()
            if v and moved["bf16"].get(k)
        )
    )


if __name__ == "__main__":
    main()
