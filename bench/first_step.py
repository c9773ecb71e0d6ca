"""Where the time to the first step goes: ``Engine(plan="auto")`` on an emulated GPU
with room to spare (or ``--device cuda:0``), a GPT-2 of ``--blocks`` x ``--hidden``,
bf16, FlatAdamW; each part of its first step timed (seconds): describing the chain,
calibrating the device (the CPU's FLOP rate, the engine's cost per task, the host's
update rate; on a GPU its links, matmul and update rates), profiling (the layers'
forward and backward at each microbatch size, the next layer's inputs, each layer's
update), the search, the fit check, placing the plan's state, and the rest: the step
itself. The calibration is made once per process: run it in a fresh one.

    python bench/first_step.py [--hidden 256] [--blocks 4] [--seq 64] [--vocab 2048]
        [--device cuda:0]
"""

from __future__ import annotations

import argparse
import time

import torch

# bench/gpu.py times each part of plan="auto"'s first step into SPENT (by name)
from gpu import PARTS, SPENT  # bench/ is on the path: run as a script

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW
from harmony.workbench.experiments import gpt2_config
from harmony.workbench.training import build_model, lm_loss, torch_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--minibatch", type=int, default=8)
    ap.add_argument("--device", default="emulated", help="emulated, or a GPU: cuda:0")
    args = ap.parse_args()
    cfg = gpt2_config(args.hidden, args.blocks, args.seq, args.vocab)
    model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", args.minibatch, **cfg)
    # torch's own lazy imports (the first optimizer made imports its compiler) are
    # not the engine's: out of the way first
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    device = (
        EmulatedDevice(memory="4GB", h2d="2GB/s", d2h="2GB/s")
        if args.device == "emulated"
        else args.device
    )
    with torch_threads(1):
        t0 = time.perf_counter()
        e = Engine(
            model,
            lambda ps: FlatAdamW(ps, lr=1e-4),
            lm_loss,
            device=device,
            minibatch_size=args.minibatch,
            plan="auto",
            precision="bf16",
        )
        made = time.perf_counter() - t0
        e.step(x, y)
        sync(args.device)
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        e.step(x, y)
        sync(args.device)
        second = time.perf_counter() - t1
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 {args.blocks} x {args.hidden}, {params / 1e6:.1f} M params, bf16, one thread")
    print(f"minibatch {args.minibatch} on {args.device}: plan {e.plan.describe()}")
    print(f"{'engine construction':32s} {made:7.2f} s")
    for _, name, label in PARTS:
        print(f"{label:32s} {SPENT.get(name, 0.0):7.2f} s")
    parts = sum(
        SPENT.get(name, 0.0)
        for _, name, label in PARTS
        if not label.startswith(" ") and name != "take"  # buffers: taken within the parts
    )
    print(f"{'the rest: the step itself':32s} {first - made - parts:7.2f} s")
    print(f"{'time to first step':32s} {first:7.2f} s")
    print(f"{'second step':32s} {second:7.2f} s")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
