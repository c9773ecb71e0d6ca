"""Model selection: several models trained together, under the three schedules.

1. Simulated on the paper's server (paper-4x1080ti, GTX 1080 Ti reference
   profiles), minibatch 16, ``--steps`` iterations per model:
   a. eight GPT-2 models of different depths (6, 12, ..., 48 blocks of GPT-2 XL,
      its embedding and head kept), the size grid of a model search;
   b. six GPT-2 XL models (a learning-rate grid: equal cost), more models than GPUs.
   Each model gets the best 1-GPU Harmony plan the search finds (task-parallel,
   merged) and its best 4-GPU plan (sequential). Printed: total time to train
   every model, sequential / merged and task-parallel / merged, GPU busy
   fraction; plus sequential with the 1-GPU plans (one model at a time on one GPU).
2. Measured on an emulated server (2 GPUs, paced links) with small GPT-2 zoo
   models (a learning-rate grid of three, profiled on this CPU): the engine
   trains them with ``harmony.train_many`` under each schedule, next to the
   simulator's prediction for the same schedule.

For context, HYDRA reports > 7x over plain model parallelism and 50-100% over
pipeline tools on multi-model workloads.

    python bench/multi_model.py [--steps 4] [--emulated-steps 3]
"""

import argparse
import os
import time
from dataclasses import replace

import pandas as pd
import torch

import harmony
from harmony import EmulatedServer, Engine, Job, Plan
from harmony.engine.profiler import profile
from harmony.workbench.experiments import depth_grid_jobs, schedules_table
from harmony.workbench.training import build_model, lm_loss, synthetic_batch

FMT = lambda v: f"{v:.3g}"  # noqa: E731


def simulated(args) -> None:
    t0 = time.perf_counter()
    depths = list(range(6, 49, 6))
    jobs = depth_grid_jobs("gpt2-xl", depths, args.minibatch, args.steps)
    print(
        f"  plans for {len(jobs)} depths searched in {time.perf_counter() - t0:.1f} s", flush=True
    )
    deepest = jobs[-1]
    grids = {
        "a. eight depths (6..48 blocks)": jobs,
        "b. six GPT-2 XL (learning-rate grid)": [
            replace(deepest, name=f"lr{i}") for i in range(6)
        ],
    }
    for title, grid in grids.items():
        t0 = time.perf_counter()
        df = schedules_table(grid)
        print(
            f"\n{title}, {args.steps} iterations each, simulated in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        print(
            df[
                ["schedule", "total_s", "over_merged", "gpu_busy", "swap_gb", "peak_gb", "fits"]
            ].to_string(index=False, float_format=FMT)
        )


def emulated(args) -> None:
    cfg = dict(
        hidden=args.hidden,
        n_layer=4,
        heads=4,
        seq_len=args.seq_len,
        max_position=args.seq_len,
        vocab=512,
        dropout=0.0,
    )
    B, u = 16, 4
    server = EmulatedServer(gpus=2, memory=args.memory, h2d=args.link, d2h=args.link)
    rates = (1e-3, 3e-4, 1e-4)
    inputs, target = synthetic_batch("gpt2-tiny", B, 0, **cfg)
    layers = list(build_model("gpt2-tiny", **cfg))
    spec = profile(
        layers,
        inputs,
        target,
        lm_loss,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        name=f"gpt2-{cfg['n_layer']}x{cfg['hidden']}",
    )
    packs = tuple((i, min(i + 2, len(layers))) for i in range(0, len(layers), 2))
    plan = Plan("harmony-pp", 1, B, u, u, packs[:-1], packs)
    data = [synthetic_batch("gpt2-tiny", B, step, **cfg) for step in range(args.emulated_steps)]
    jobs = [Job(spec, plan, args.emulated_steps, f"lr {lr}") for lr in rates]
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    print(
        f"  {len(rates)} x {spec.name} ({params / 1e6:.2f} M params), {plan.describe()}, "
        f"{args.emulated_steps} steps each; server: {server.gpus} GPUs x "
        f"{server.memory}, links {server.h2d}"
    )
    rows = []
    for schedule in harmony.planner.multi_model.SCHEDULES:
        engines = [
            Engine(
                build_model("gpt2-tiny", **cfg),
                lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr),
                lm_loss,
                device=server.device(),
                minibatch_size=B,
                plan=plan,
            )
            for lr in rates
        ]
        run = harmony.train_many(
            engines, [data] * len(rates), server, schedule, specs=[spec] * len(rates)
        )
        sim = harmony.simulate_many(jobs, server.hardware(), schedule)
        rows.append(
            {
                "schedule": schedule,
                "measured_s": run.total_s,
                "simulated_s": sim.total_s,
                "measured_over_simulated": run.total_s / sim.total_s,
                "measured_gpu_busy": run.row()["gpu_busy"],
                "peak_mb": run.row()["peak_gb"] * 1e3,
            }
        )
    df = pd.DataFrame(rows)
    merged = df.set_index("schedule").loc["merged"]
    df["measured_over_merged"] = df.measured_s / merged.measured_s
    df["simulated_over_merged"] = df.simulated_s / merged.simulated_s
    print(df.to_string(index=False, float_format=FMT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="iterations per model, simulated part")
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--emulated-steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256, help="emulated part: GPT-2 width")
    ap.add_argument("--seq-len", type=int, default=32, help="emulated part: tokens per sample")
    ap.add_argument(
        "--link", default="50MB/s", help="emulated part: each GPU's link, per direction"
    )
    ap.add_argument("--memory", default="48MB", help="emulated part: each GPU's memory")
    ap.add_argument("--skip-simulated", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"cores: {os.cpu_count()}")
    if not args.skip_simulated:
        print("\n== paper-4x1080ti, simulated (1080 Ti profiles) ==", flush=True)
        simulated(args)
    print("\n== emulated server, measured by the engine (train_many) vs simulated ==", flush=True)
    emulated(args)


if __name__ == "__main__":
    main()
