"""What the engine costs per task, beyond the work the task does.

A chain of tiny layers (8 x Linear(4, 4)) with one pack per layer, so the
graph has many tasks and almost no compute or bytes: the step time divided by
the number of tasks is the engine's own cost per task (Python, locks, lane
threads, ledger). Printed for the cpu and emulated backends, next to a plain
PyTorch loop over the same microbatches (its time per layer call is what the
compute alone costs).

    python bench/task_overhead.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch import nn

from harmony import EmulatedDevice, Engine, Plan, reference_step
from harmony.workbench.training import torch_threads


def timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    packs = tuple((i, i + 1) for i in range(len(layers)))
    plan = Plan("harmony-pp", 1, 8, 2, 2, packs[:-1], packs)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.0)  # noqa: E731
    opt = sgd(layers.parameters())
    rows = []
    with torch_threads(1):
        plain = timed(
            lambda: reference_step(list(layers), nn.functional.mse_loss, opt, x, y, 2, 0),
            args.steps,
        )
        for name, device in (
            ("cpu", "cpu"),
            ("emulated", EmulatedDevice(memory="1GB", h2d="1TB/s", d2h="1TB/s")),
        ):
            engine = Engine(
                layers,
                sgd,
                nn.functional.mse_loss,
                device=device,
                minibatch_size=8,
                plan=plan,
                safe_updates=False,
            )
            step = timed(lambda: engine.step(x, y), args.steps)
            tasks = engine._graph_cache.tasks
            kinds = Counter(t.kind for t in tasks)
            rows.append((name, step, len(tasks), kinds))
    print(
        f"plain loop: {plain * 1e3:.2f} ms/step (4 microbatches x 8 layers, forward + backward + "
        "SGD)"
    )
    print("| backend | ms/step | tasks | us/task | engine / plain loop |")
    print("|---|---|---|---|---|")
    for name, step, n, kinds in rows:
        print(f"| {name} | {step * 1e3:.2f} | {n} | {step / n * 1e6:.0f} | {step / plain:.1f} |")
    print("tasks by kind:", dict(rows[0][3]))


if __name__ == "__main__":
    main()
