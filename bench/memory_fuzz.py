"""Plans the planner says fit never run out of memory in the engine, on models
nobody wrote a test for: ``--models`` random models (:func:`harmony.testing.random_model`:
MLPs, residual CNNs with BatchNorm, transformers, tied-head language models)
on random emulated servers (1-2 GPUs, 40 KB - 2 MB each), planned with
``plan="auto"``, two steps each. Prints how many were tried, how many found a
plan, and for those: runs out of memory (must be 0), measured peak / simulated
peak (must be 1), bytes held beyond what the spec declared (must be 0), declared
working memory a task never held (must be 0).

    .venv/bin/python bench/memory_fuzz.py [--models 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from harmony import EmulatedDevice, EmulatedServer, Engine, OutOfMemoryError
from harmony.simulate import simulate_graph
from harmony.testing import random_model
from harmony.workbench.training import torch_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minibatch", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tried = planned = out_of_memory = 0
    ratios, undeclared, unheld, kinds = [], [], [], {}
    t0 = time.perf_counter()
    with torch_threads(1):
        for _ in range(args.models):
            seed, gpus, kb = (
                rng.randrange(2**31),
                rng.choice([1, 1, 2]),
                int(40 * 50 ** rng.random()),
            )
            model, inputs, target, loss = random_model(seed, args.minibatch)
            device = (
                EmulatedDevice(memory=f"{kb}KB", h2d="2GB/s", d2h="2GB/s")
                if gpus == 1
                else EmulatedServer(gpus=gpus, memory=f"{kb}KB", h2d="2GB/s", d2h="2GB/s")
            )
            engine = Engine(
                model,
                lambda ps: torch.optim.SGD(ps, lr=0.01),
                loss,
                device=device,
                minibatch_size=args.minibatch,
            )
            tried += 1
            try:
                engine.step(inputs, target)
            except OutOfMemoryError:
                if engine.plan is not None:
                    out_of_memory += 1  # a chosen plan ran out: the failure this bench looks for
                continue
            planned += 1
            kinds[type(model[-1]).__name__] = kinds.get(type(model[-1]).__name__, 0) + 1
            try:
                engine.step(inputs, target)
            except OutOfMemoryError:
                out_of_memory += 1
                continue
            s = engine.trace.summary
            simulated = simulate_graph(engine._graph_cache).summary.peak_memory
            ratios += [
                s.peak_memory[g] / simulated[g] if simulated[g] else 1.0 + s.peak_memory[g]
                for g in simulated
            ]  # a GPU the plan leaves idle holds nothing
            undeclared += list(s.undeclared_bytes.values())
            unheld += list(s.unheld_work_bytes.values())
    print(
        f"{tried} models tried in {time.perf_counter() - t0:.0f} s; {planned} got a plan from "
        f"plan='auto' ({tried - planned} had none that fits: refused before any task ran)"
    )
    print(f"chosen plans that ran out of memory: {out_of_memory}")
    if ratios:
        print(
            f"measured / simulated peak per GPU: min {min(ratios):.4f} max {max(ratios):.4f} over "
            f"{len(ratios)}"
        )
        print(f"bytes held beyond the spec's declaration: max {max(undeclared):.0f}")
        print(f"declared working memory a task never held: max {max(unheld):.0f}")


if __name__ == "__main__":
    main()
