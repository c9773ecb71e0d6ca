"""Scaling with GPUs: measured on an emulated server, and simulated on the paper's.

1. Emulated: a GPT-2-style model on 1, 2 and 4 emulated GPUs (each with its
   own paced link, all behind one uplink as fast as two of them), Harmony-PP
   and Harmony-DP with the same packs and microbatches; samples/s measured by
   the engine and predicted by the simulator for the same plans on the
   measured profile; scaling efficiency throughput_N / (N * throughput_1).
   The emulated GPUs compute on this machine's cores, so measured compute
   scales only up to the number of free cores: the link-bound part is what
   the emulation can show.
2. Simulated: the best plan the search finds for GPT-2 10B/20B/30B/40B (1080 Ti
   reference profiles) on 1, 2, 4 GPUs of paper-4x1080ti and 8 of
   paper-8x1080ti; the paper reports linear scaling.
3. The timeline of one 4-GPU Harmony-PP step (emulated) is written to
   figures/scaling_pp4_timeline.{svg,png}.

    python bench/scaling.py [--steps 3] [--quick]
"""

import argparse
import os
import statistics
import time

import pandas as pd
import torch

import harmony
from harmony import EmulatedServer, Engine, Plan
from harmony.engine.profiler import profile
from harmony.workbench.training import build_model, lm_loss


def emulated(args) -> pd.DataFrame:
    cfg = dict(hidden=128, n_layer=6, heads=4, seq_len=64, max_position=64, vocab=512)
    B, u = 32, 4
    (x,), y = harmony.zoo.example_input("gpt2-tiny", B, **cfg)
    loss = lm_loss
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731

    def build():
        return build_model("gpt2-tiny", 0, dropout=0.0, **cfg)

    spec = profile(list(build()), (x,), y, loss, opt, name="gpt2-scaling")
    n_layers = len(spec)
    packs = tuple((i, min(i + 2, n_layers)) for i in range(0, n_layers, 2))
    rows = []
    for n in (1, 2, 4):
        server = EmulatedServer(
            gpus=n, memory="16MB", h2d="20MB/s", d2h="20MB/s", uplink="40MB/s", p2p="20MB/s"
        )
        for policy in ("harmony-pp", "harmony-dp"):
            if policy == "harmony-dp" and n == 1:
                continue
            plan = Plan(policy, n, B, u, u, packs[:-1], packs)
            engine = Engine(build(), opt, loss, device=server, minibatch_size=B, plan=plan)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step(x, y)
                times.append(time.perf_counter() - t0)
            measured = statistics.median(times[1:]) if len(times) > 1 else times[0]
            sim = harmony.simulate(spec, server.hardware(), plan).summary.iteration_s
            rows.append(
                {
                    "policy": policy,
                    "gpus": n,
                    "measured_samples_s": B / measured,
                    "simulated_samples_s": B / sim,
                    "measured_over_simulated": measured / sim,
                }
            )
            if policy == "harmony-pp" and n == 4:
                from harmony.workbench.charts import save, timeline_chart

                save(
                    timeline_chart(
                        engine.trace, title=f"Harmony-PP on 4 emulated GPUs: {plan.describe()}"
                    ),
                    os.path.join("figures", "scaling_pp4_timeline"),
                )
    df = pd.DataFrame(rows)
    for col in ("measured", "simulated"):
        one = df[(df.gpus == 1)][f"{col}_samples_s"].iloc[0]
        df[f"{col}_efficiency"] = df[f"{col}_samples_s"] / (df.gpus * one)
    return df


def simulated(args) -> pd.DataFrame:
    rows = []
    models = ["gpt2-10b"] if args.quick else ["gpt2-10b", "gpt2-20b", "gpt2-30b", "gpt2-40b"]
    for name in models:
        spec = harmony.model_spec(name)
        for n, preset in (
            (1, "paper-4x1080ti"),
            (2, "paper-4x1080ti"),
            (4, "paper-4x1080ti"),
            (8, "paper-8x1080ti"),
        ):
            t0 = time.perf_counter()
            df = harmony.search(
                spec,
                harmony.preset(preset),
                args.minibatch,
                n_gpus=n,
                policies=("harmony-pp", "harmony-dp"),
            )
            best = df.iloc[0]
            rows.append(
                {
                    "model": name,
                    "gpus": n,
                    "best": best.plan.describe(),
                    "samples_s": best.samples_per_s,
                    "search_s": time.perf_counter() - t0,
                }
            )
            print(rows[-1], flush=True)
    out = pd.DataFrame(rows)
    one = out[out.gpus == 1].set_index("model").samples_s
    out["efficiency"] = out.samples_s / (out.gpus * out.model.map(one))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--minibatch", type=int, default=32, help="minibatch of the simulated GPT-2 billions runs"
    )
    ap.add_argument("--quick", action="store_true", help="GPT-2 10B only in the simulated part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fmt = lambda v: f"{v:.3g}"  # noqa: E731
    print(
        f"cores: {os.cpu_count()}\n\n== emulated server (measured by the engine vs simulated) =="
    )
    print(emulated(args).to_string(index=False, float_format=fmt))
    print("\n== GPT-2 billions on the paper's servers (simulated, best plan per GPU count) ==")
    print(simulated(args).drop(columns=["best"]).to_string(index=False, float_format=fmt))


if __name__ == "__main__":
    main()
