"""Engine overhead on the `cpu` backend, where nothing moves: engine step time /
plain PyTorch step time with the same microbatches and optimizer, measured side
by side in one run. Goals: <= 1.05 (one fused pack), <= 1.03 (a pack per layer).

Three comparisons, because packing changes the work itself:
* one fused pack (no stash, no recompute) vs `harmony.reference_step`: the
  engine's own cost (tasks, per-pack optimizers, the rollback journal);
* a pack per layer (every layer recomputed in backward, as Harmony does) vs
  the same plain loop with `torch.utils.checkpoint` around every layer, which
  does the same recompute;
* ``plan="auto"`` on an emulated GPU with room to spare (it picks the resident
  plan: weights, gradients and optimizer state on the device) vs the plain
  loop at the microbatch size it chose.

How it measures, so that a figure can be told from noise: the run is ``--rounds``
rounds (after ``--warmup`` untimed ones); in each round every variant plays
``--steps`` steps, one variant after another, in an order that rotates from
round to round (so drift, and whatever ran just before, hit every variant
alike). Each round gives each variant a ratio to its plain loop *of the same
round*; the bench prints the median of those ratios and their spread (min and
max over the rounds), and the ratio of the two variants' fastest rounds (other
work only ever adds time, so the fastest rounds are the least disturbed), for
wall time and for the process's CPU time
(``time.process_time``: every thread of this process, none of other
processes'). On a quiet machine wall time is the figure; on a shared one CPU
time is the steadier (it does not count the time another process held the
core, though cache and memory bandwidth are still shared), and the load
average, printed before and after, says which the run was.

    python bench/overhead.py [--rounds 30] [--steps 1] [--hidden 256] [--blocks 4]
"""

import argparse
import os
import statistics
import time

import torch
import torch.utils.checkpoint
from torch import nn

import harmony
from harmony import Engine, Plan, reference_step
from harmony.workbench.training import build_model, lm_loss


def build(hidden, blocks):
    return build_model(
        "gpt2-tiny",
        0,
        hidden=hidden,
        n_layer=blocks,
        heads=4,
        seq_len=64,
        max_position=64,
        vocab=512,
        dropout=0.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds")
    ap.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--microbatch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one compute thread both ways: the comparison is about the engine
    B, u = args.minibatch, args.microbatch
    (x,), y = harmony.zoo.example_input(
        "gpt2-tiny",
        B,
        hidden=args.hidden,
        n_layer=args.blocks,
        heads=4,
        seq_len=64,
        max_position=64,
        vocab=512,
    )
    loss = lm_loss
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    n = args.blocks + 3
    packs = tuple(
        (i, i + 1) for i in range(n)
    )  # a pack per layer: the most tasks, the most overhead

    def plain(checkpointed):
        model = build(args.hidden, args.blocks)
        optimizer = opt(list(model.parameters()))
        layers = [Checkpointed(layer) for layer in model] if checkpointed else list(model)
        return lambda step: reference_step(layers, loss, optimizer, (x,), y, u, step)

    def engine(bwd, safe=True):
        plan = Plan("harmony-pp", 1, B, u, u, bwd[:-1], bwd)
        e = Engine(build(args.hidden, args.blocks), opt, loss, "cpu", B, plan, safe_updates=safe)
        return lambda step: e.step(x, y)

    # plan="auto" on a roomy emulated GPU: profiled and searched at its first step (untimed)
    roomy = harmony.EmulatedDevice(memory="8GB", h2d="12GB/s", d2h="12GB/s")
    auto = Engine(build(args.hidden, args.blocks), opt, loss, roomy, B, "auto")
    auto.step(x, y)
    auto_u = auto.plan.bwd_microbatch

    def plain_at(u):
        model = build(args.hidden, args.blocks)
        optimizer = opt(list(model.parameters()))
        return lambda step: reference_step(list(model), loss, optimizer, (x,), y, u, step)

    one = ((0, n),)
    variants = {
        "plain loop": plain(False),
        "engine, one fused pack": engine(one),
        "engine, one fused pack, no rollback journal": engine(one, safe=False),
        "plain loop, checkpoint per layer": plain(True),
        "engine, pack per layer": engine(packs),
        "engine, pack per layer, no rollback journal": engine(packs, safe=False),
        "plain loop, auto's microbatch": plain_at(auto_u),
        "engine, plan='auto', roomy emulated GPU": lambda step: auto.step(x, y),
    }
    baseline = {
        name: "plain loop"
        if "fused" in name
        else "plain loop, auto's microbatch"
        if "auto" in name
        else "plain loop, checkpoint per layer"
        for name in variants
        if not name.startswith("plain loop")
    }
    load_before = os.getloadavg()
    wall, cpu = play(variants, args.rounds, args.warmup, args.steps)
    params = sum(p.numel() for p in build(args.hidden, args.blocks).parameters())
    print(
        f"model: GPT-2 style, {args.blocks} blocks x {args.hidden}, {params:,} params; minibatch "
        f"{B}, microbatch {u}, {n} layers; torch threads 1"
    )
    print(
        f"{args.rounds} rounds of {args.steps} steps per variant (after {args.warmup} untimed), "
        f"interleaved; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"plan='auto' on the roomy emulated GPU: {auto.plan.describe()}")
    report(wall, cpu, baseline, args.steps)


def play(variants: dict, rounds: int, warmup: int, steps: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of each variant in each timed round (``steps`` steps each),
    the variants taking turns in an order that rotates every round."""
    names = list(variants)
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    step = {k: 0 for k in names}
    for r in range(warmup + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                variants[name](step[name])
                step[name] += 1
            w, c = time.perf_counter() - w0, time.process_time() - c0
            if r >= warmup:
                wall[name].append(w)
                cpu[name].append(c)
    return wall, cpu


def spread(times: list[float], base: list[float]) -> str:
    """The median of the per-round ratios [their smallest-largest], and the ratio
    of the fastest rounds."""
    ratios = sorted(t / b for t, b in zip(times, base))
    median = statistics.median(ratios)
    return f"{median:.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}] {min(times) / min(base):.3f}"


def report(wall: dict, cpu: dict, baseline: dict, steps: int) -> None:
    print(
        f"{'':46s} {'wall ms/step':>12s} {'CPU ms/step':>12s}   "
        f"{'wall ratio [min-max] fastest':28s} CPU ratio [min-max] fastest"
    )
    for name in wall:
        w = statistics.median(wall[name]) / steps * 1e3
        c = statistics.median(cpu[name]) / steps * 1e3
        line = f"{name:46s} {w:12.1f} {c:12.1f}"
        if name in baseline:
            base = baseline[name]
            line += f"   {spread(wall[name], wall[base]):28s} {spread(cpu[name], cpu[base])}"
        print(line)


class Checkpointed(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False)


if __name__ == "__main__":
    main()
