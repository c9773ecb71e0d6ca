"""The planner's search with this code and with an older one, side by side in one
process: GPT-2 XL on the paper's 4-GPU server at minibatch 64, one worker (the
CPU time is all in this process). The older search, this one simulating every
candidate, and this one with ``prune=True`` take turns, round after round (the
order reversed every other round); prints per round and variant the CPU and wall
seconds, the candidates simulated and the best plan, then the medians and each
variant's CPU time over the older one's. ``--before``: a folder holding the older
``harmony`` package (as for ``bench/build_speed.py``).

    python bench/search_versions.py --before /tmp/old [--rounds 3]
"""

import argparse
import statistics
import time

from build_speed import load_before

import harmony


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="folder with the older harmony package")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    old = load_before(args.before)
    spec, hw = harmony.model_spec("gpt2-xl"), harmony.preset("paper-4x1080ti")
    old_spec, old_hw = old.model_spec("gpt2-xl"), old.preset("paper-4x1080ti")
    variants = {
        "before": lambda: old.search(old_spec, old_hw, 64, workers=1),
        "after, every candidate": lambda: harmony.search(spec, hw, 64, workers=1),
        "after, prune=True": lambda: harmony.search(spec, hw, 64, workers=1, prune=True),
    }
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in list(variants) if r % 2 == 0 else list(reversed(variants)):
            c0, w0 = time.process_time(), time.perf_counter()
            df = variants[v]()
            cpu[v].append(time.process_time() - c0)
            wall[v].append(time.perf_counter() - w0)
            best = df.iloc[0]
            print(
                f"round {r} {v}: CPU {cpu[v][-1]:.2f} s, wall {wall[v][-1]:.2f} s, "
                f"{df.attrs['simulated']} simulated, best {best.plan.describe()} "
                f"{best.iteration_s:.4f} s/iter",
                flush=True,
            )
    before = statistics.median(cpu["before"])
    for v in variants:
        c, w = statistics.median(cpu[v]), statistics.median(wall[v])
        print(
            f"{v}: CPU {c:.2f} s, wall {w:.2f} s (medians of {args.rounds}), "
            f"CPU / before's {c / before:.2f}"
        )


if __name__ == "__main__":
    main()
