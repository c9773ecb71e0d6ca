"""Harmony's recompute overlap, on and off, side by side in one run.

A backward pack recomputes a microbatch's forward (REC) as soon as the pack's
weights and the stashed input are on the GPU, while the microbatch's output
gradient is still on its way; only the backward proper (BWD) waits for the
gradient. The ablation is the same plan with the plan option
``overlap_recompute`` off: REC then waits for the gradient as well.

1. Simulated on the paper's server (``paper-4x1080ti``, the 1080 Ti reference
   profiles): for ResNet-1026, GPT-2 XL and BERT-96, the best harmony-pp and
   harmony-dp plans ``harmony.search`` finds at minibatch 32 and 64 (searched
   with the overlap, Harmony's schedule); each plan's iteration time with the
   overlap and without, and their ratio.
2. Measured on an emulated 2-GPU server (a GPT-2-style model profiled on this
   CPU, host links paced to a 1080 Ti's compute : PCIe ratio as in
   ``bench/emulated.py``, the peer link to the paper server's P2P : PCIe
   ratio): harmony-pp with one layer per pack and two microbatches per pack,
   where the overlap matters most (each pack's first recompute can hide behind
   the previous pack's compute and the gradient's flight), run by the engine
   with the overlap and without, steps interleaved so that drift in the
   machine's load hits both alike; median s/step of each, their ratio, and
   the simulated ratio for the same plans.

    python bench/recompute_overlap.py [--steps 9] [--workers 1] [--quick]
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch

import harmony
from harmony import EmulatedServer, Engine, Plan
from harmony.engine.calibrate import calibrate
from harmony.engine.profiler import FLOP_PER_BYTE_1080TI, cpu_flops, profile
from harmony.workbench.training import build_model, lm_loss

MODELS = ("resnet1026", "gpt2-xl", "bert-96")
#: the paper server's GPU->GPU : host->GPU bandwidth (8.2 and 11.5 GiB/s)
P2P_RATIO = 8.2 / 11.5
POLICIES = ("harmony-pp", "harmony-dp")


def without_overlap(plan: Plan) -> Plan:
    return replace(plan, options={**dict(plan.options), "overlap_recompute": False})


def simulated(args) -> None:
    hw = harmony.preset("paper-4x1080ti")
    print(f"### Simulated on {hw.name} (best plan of each search, with the overlap and without)\n")
    print(
        "| model | policy | minibatch | plan | with overlap (s) | without (s) | without / with |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in MODELS[:1] if args.quick else MODELS:
        spec = harmony.model_spec(name)
        for policy in POLICIES:
            for minibatch in (32,) if args.quick else (32, 64):
                best = harmony.search(
                    spec, hw, minibatch, policies=(policy,), workers=args.workers
                ).iloc[0]
                on = harmony.simulate(spec, hw, best.plan).summary
                off = harmony.simulate(spec, hw, without_overlap(best.plan)).summary
                note = "" if off.fits else " (over capacity)"
                print(
                    f"| {name} | {policy} | {minibatch} | {best.plan.describe()} "
                    f"| {on.iteration_s:.2f} | {off.iteration_s:.2f}{note} "
                    f"| {off.iteration_s / on.iteration_s:.3f} |"
                )


def measured(args) -> None:
    torch.set_num_threads(1)
    cfg = dict(
        hidden=args.hidden, n_layer=args.blocks, heads=4, seq_len=64, max_position=64, vocab=512
    )
    (x,), y = harmony.zoo.example_input("gpt2-tiny", args.minibatch, **cfg)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    rate = cpu_flops() / FLOP_PER_BYTE_1080TI
    server = EmulatedServer(gpus=2, memory=args.memory, h2d=rate, d2h=rate, p2p=P2P_RATIO * rate)
    spec = profile(
        list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg)),
        (x,),
        y,
        lm_loss,
        opt,
        name="gpt2-bench",
    )
    hw = calibrate(server)
    plan = Plan.uniform(
        "harmony-pp",
        2,
        args.minibatch,
        args.minibatch // 2,
        num_layers=len(spec),
        layers_per_pack=1,
    )
    print(
        f"\n### Measured on an emulated 2-GPU server ({args.memory} each, host links "
        f"{rate / 1e6:.1f} MB/s, p2p {P2P_RATIO * rate / 1e6:.1f} MB/s), gpt2-tiny hidden "
        f"{args.hidden} x {args.blocks} blocks, minibatch {args.minibatch}\n"
    )
    print(
        f"plan: {plan.describe()}; median of {args.steps - 1} interleaved steps "
        "(the first is warm-up)\n"
    )
    plans = {"with overlap": plan, "without": without_overlap(plan)}
    engines = {
        label: Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            opt,
            lm_loss,
            device=server,
            minibatch_size=args.minibatch,
            plan=p,
            spec=spec,
        )
        for label, p in plans.items()
    }
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(args.steps):
        for label, engine in engines.items():
            t0 = time.perf_counter()
            engine.step(x, y)
            times[label].append(time.perf_counter() - t0)
    print("| run | measured s/step | simulated s/step | measured peak = simulated |")
    print("|---|---|---|---|")
    median = {label: statistics.median(t[1:]) for label, t in times.items()}
    sims = {label: harmony.simulate(spec, hw, p).summary for label, p in plans.items()}
    for label, engine in engines.items():
        same = engine.trace.summary.peak_memory == sims[label].peak_memory
        print(f"| {label} | {median[label]:.3f} | {sims[label].iteration_s:.3f} | {same} |")
    print(
        f"\nwithout / with overlap: measured {median['without'] / median['with overlap']:.3f}, "
        f"simulated {sims['without'].iteration_s / sims['with overlap'].iteration_s:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--workers", type=int, default=1, help="search processes")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--memory", default="96MB")
    ap.add_argument("--quick", action="store_true", help="one model, one minibatch, 3 steps")
    args = ap.parse_args()
    if args.quick:
        args.steps = min(args.steps, 3)
    simulated(args)
    measured(args)


if __name__ == "__main__":
    main()
