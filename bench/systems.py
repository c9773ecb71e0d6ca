"""Every system as a policy, side by side: Harmony (pipeline and data parallel),
the virtualized-memory baseline, KARMA, HYDRA, ZeRO-Offload and GPipe with
swapping.

1. Simulated: GPT-2 XL and BERT-96 (1080 Ti reference profiles) on the
   paper's server (paper-4x1080ti) at two minibatch sizes, the best plan of
   each policy: the search's for the policies it plans, the policy's own
   ``choose_plan`` for the others (HYDRA spills one model on one GPU;
   ZeRO-Offload and GPipe-swap use all four). Printed per iteration:
   samples/s, bytes between host and GPUs, bytes between GPUs.
2. Measured: a GPT-2-style zoo model several times larger than an emulated
   GPU, on an emulated server of two GPUs whose links are paced so that
   compute : bandwidth matches a 1080 Ti on PCIe 3.0 (as bench/emulated.py),
   both behind one uplink as fast as one link and with peer copies at the
   paper's P2P : PCIe ratio. Each policy's plan is chosen (search or
   ``choose_plan``) on the profile measured here, and the engine runs it:
   samples/s (median of the steps after a warm-up step) and bytes moved,
   measured, next to the simulated samples/s of the same plan.

    python bench/systems.py [--models gpt2-xl,bert-96] [--minibatches 16,64] [--steps 2] \
        [--no-measured]
"""

import argparse
import time

import pandas as pd
import torch

import harmony
from harmony import EmulatedServer, Engine, OutOfMemoryError
from harmony.engine.calibrate import calibrate
from harmony.engine.profiler import link_like_1080ti, profile
from harmony.planner import plans_for
from harmony.trace import Summary
from harmony.workbench.experiments import median_step_s, systems_table
from harmony.workbench.training import build_model, lm_loss

POLICIES = list(harmony.POLICIES)
PAPER_P2P_OVER_PCIE = 8.2 / 11.5  # paper-4x1080ti: peer copies vs host link


def moved(summary: Summary) -> dict:
    kinds = summary.bytes_by_kind
    return {
        "host<->GPU GB": summary.swap_bytes / 1e9,
        "GPU<->GPU GB": (kinds.get("P2P", 0.0) + kinds.get("REDUCE", 0.0)) / 1e9,
    }


def plan_text(plan) -> str:
    return (
        f"x{plan.n_gpus} uF={plan.fwd_microbatch} uB={plan.bwd_microbatch} "
        f"F{len(plan.fwd_packs)}/B{len(plan.bwd_packs)}"
    )


def versus_baseline(rows: list[dict]) -> list[dict]:
    """``rows`` (one per policy, same model and minibatch) with samples/s over the baseline's."""
    base = next(r["samples/s"] for r in rows if r["policy"] == "harmony-no-grouping")
    return [{**r, "vs harmony-no-grouping": r["samples/s"] / base} for r in rows]


def simulated(args) -> pd.DataFrame:
    df = systems_table(
        args.models.split(","), [int(b) for b in args.minibatches.split(",")], args.hardware
    )
    return df.rename(
        columns={
            "samples_per_s": "samples/s",
            "host_gpu_gb": "host<->GPU GB",
            "gpu_gpu_gb": "GPU<->GPU GB",
            "vs_virtual_memory": "vs harmony-no-grouping",
        }
    )


def measured(args) -> pd.DataFrame:
    torch.set_num_threads(1)
    cfg = dict(
        hidden=args.hidden, n_layer=args.blocks, heads=4, seq_len=64, max_position=64, vocab=512
    )
    B = args.minibatch
    (x,), y = harmony.zoo.example_input("gpt2-tiny", B, **cfg)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    rate = link_like_1080ti()
    server = EmulatedServer(
        gpus=2, memory=args.memory, h2d=rate, d2h=rate, uplink=rate, p2p=PAPER_P2P_OVER_PCIE * rate
    )
    layers = list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg))
    spec = profile(layers, (x,), y, lm_loss, opt, name="gpt2-systems")
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    footprint = params * 4 * 4 + sum(c.bwd_extra(B) for c in spec.layers)
    capacity = server.device().capacity
    print(
        f"  emulated server: 2 GPUs of {capacity / 1e6:.0f} MB, links {rate / 1e6:.1f} MB/s per "
        f"direction (one uplink as fast), P2P {PAPER_P2P_OVER_PCIE * rate / 1e6:.1f} MB/s; model "
        f"{params:,} params, training footprint {footprint / 1e6:.0f} MB = "
        f"{footprint / capacity:.1f}x one GPU",
        flush=True,
    )
    hw = calibrate(server)
    rows = []
    for policy, plan in plans_for(POLICIES, spec, hw, B, workers=1).items():
        sim = harmony.simulate(spec, hw, plan).summary
        row = {
            "policy": policy,
            "plan": plan_text(plan),
            "simulated samples/s": sim.samples_per_s,
            "simulated peak MB": max(sim.peak_memory.values()) / 1e6,
        }
        device = server if plan.n_gpus == server.gpus else server.device()
        engine = Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            opt,
            lm_loss,
            device=device,
            minibatch_size=B,
            plan=plan,
            spec=spec,
        )
        try:
            step_s = median_step_s(engine, (x,), y, args.steps)
        except OutOfMemoryError as err:  # the engine's timing can differ from the simulator's
            print(f"  {policy}: {err}", flush=True)
            rows.append({**row, "samples/s": float("nan")})
            continue
        s = engine.trace.summary
        volume = harmony.swap_volume(engine.spec, plan)
        rows.append(
            {
                **row,
                "samples/s": B / step_s,
                "peak MB": max(s.peak_memory.values()) / 1e6,
                **{k.replace("GB", "MB"): v * 1e3 for k, v in moved(s).items()},
                "bytes = closed form": all(
                    abs(s.bytes_by_kind.get(k, 0.0) - v) <= 1e-9 * max(v, 1.0)
                    for k, v in volume.items()
                ),
            }
        )
        print(f"  {policy}: {rows[-1]['samples/s']:.2f} samples/s", flush=True)
    return pd.DataFrame(versus_baseline(rows))[
        [
            "policy",
            "plan",
            "samples/s",
            "simulated samples/s",
            "vs harmony-no-grouping",
            "host<->GPU MB",
            "GPU<->GPU MB",
            "bytes = closed form",
            "peak MB",
            "simulated peak MB",
        ]
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-xl,bert-96")
    ap.add_argument("--minibatches", default="16,64")
    ap.add_argument("--hardware", default="paper-4x1080ti")
    ap.add_argument("--steps", type=int, default=2, help="measured steps after a warm-up step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--minibatch", type=int, default=32, help="of the measured section")
    ap.add_argument("--memory", default="24MB", help="of each emulated GPU")
    ap.add_argument("--no-measured", action="store_true")
    args = ap.parse_args()
    fmt = dict(index=False, float_format=lambda v: f"{v:.3g}")
    t0 = time.perf_counter()
    print(f"simulated on {args.hardware}, best plan per policy:", flush=True)
    sim = simulated(args)
    if not args.no_measured:
        print("\nmeasured on an emulated server:", flush=True)
        real = measured(args)
    print(f"\nsimulated, {args.hardware} (1080 Ti reference profiles)")
    print(sim.to_string(**fmt))
    if not args.no_measured:
        print(
            f"\nmeasured, engine on 2 emulated GPUs, minibatch {args.minibatch}, median of "
            f"{args.steps} steps"
        )
        print(real.to_string(**fmt))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
