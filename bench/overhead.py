"""Engine overhead on the `cpu` backend, where nothing moves: engine step time /
plain PyTorch step time with the same microbatches and optimizer, medians over
repeats, measured side by side (interleaved) in one run. Goal <= 1.05.

Three comparisons, because packing changes the work itself:
* one fused pack (no stash, no recompute) vs `harmony.reference_step`: the
  engine's own cost (tasks, threads, per-pack optimizers);
* a pack per layer (every layer recomputed in backward, as Harmony does) vs
  the same plain loop with `torch.utils.checkpoint` around every layer, which
  does the same recompute;
* ``plan="auto"`` on an emulated GPU with room to spare (it picks the resident
  plan: weights, gradients and optimizer state on the device) vs the plain
  loop at the microbatch size it chose.

    python bench/overhead.py [--steps 12] [--hidden 256] [--blocks 4]
"""

import argparse
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
    ap.add_argument("--steps", type=int, default=12)
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
    times = {k: [] for k in variants}
    for step in range(args.steps):  # interleaved, so drift hits every variant alike
        for name, run in variants.items():
            t0 = time.perf_counter()
            run(step)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    params = sum(p.numel() for p in build(args.hidden, args.blocks).parameters())
    print(
        f"model: GPT-2 style, {args.blocks} blocks x {args.hidden}, {params:,} params; minibatch "
        f"{B}, microbatch {u}, {n} layers; torch threads 1; median of {args.steps - 2} steps"
    )
    print(f"plan='auto' on the roomy emulated GPU: {auto.plan.describe()}")
    for name, t in med.items():
        base = (
            med["plain loop"]
            if "fused" in name or name == "plain loop"
            else med["plain loop, auto's microbatch"]
            if "auto" in name
            else med["plain loop, checkpoint per layer"]
        )
        print(f"{name:46s} {t * 1e3:8.1f} ms/step   ratio {t / base:.3f}")


class Checkpointed(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False)


if __name__ == "__main__":
    main()
