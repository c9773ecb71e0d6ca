"""The planner's search with this code and with an older one, side by side in one
process: GPT-2 XL on the paper's 4-GPU server at minibatch 64. Each version
searches with each worker count of ``--workers`` and each setting of ``--prune``;
the variants take turns, round after round (the order reversed every other
round); prints per round and variant the CPU seconds (this process and its worker
processes together: what two idle cores would split), the wall seconds, the
candidates simulated and the best plan, then the medians and each variant's CPU
and wall time over the older code's with the same workers and pruning.
``--before``: a folder holding the older ``harmony`` package (as for
``bench/build_speed.py``).

    python bench/search_versions.py --before /tmp/old [--rounds 3] [--workers 1,2]
        [--prune off,on]
"""

import argparse
import resource
import statistics
import time

from build_speed import load_before

import harmony


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (a search's
    worker processes end with it)."""
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="folder with the older harmony package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default="1", help="worker counts, comma-separated")
    ap.add_argument("--prune", default="off,on", help="off and/or on, comma-separated")
    args = ap.parse_args()
    old = load_before(args.before)
    versions = {
        "before": (old, old.model_spec("gpt2-xl"), old.preset("paper-4x1080ti")),
        "after": (harmony, harmony.model_spec("gpt2-xl"), harmony.preset("paper-4x1080ti")),
    }
    settings = [
        (int(w), {"off": False, "on": True}[p])
        for w in args.workers.split(",")
        for p in args.prune.split(",")
    ]
    variants = {
        (v, w, p): (lambda m=m, s=s, h=h, w=w, p=p: m.search(s, h, 64, workers=w, prune=p))
        for w, p in settings
        for v, (m, s, h) in versions.items()
    }
    cpu: dict[tuple, list[float]] = {v: [] for v in variants}
    wall: dict[tuple, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in list(variants) if r % 2 == 0 else list(reversed(variants)):
            c0, w0 = cpu_seconds(), time.perf_counter()
            df = variants[v]()
            cpu[v].append(cpu_seconds() - c0)
            wall[v].append(time.perf_counter() - w0)
            best = df.iloc[0]
            print(
                f"round {r} {name(v)}: CPU {cpu[v][-1]:.2f} s, wall {wall[v][-1]:.2f} s, "
                f"{df.attrs['simulated']} simulated, best {best.plan.describe()} "
                f"{best.iteration_s:.4f} s/iter",
                flush=True,
            )
    for v in variants:
        c, w = statistics.median(cpu[v]), statistics.median(wall[v])
        base = ("before",) + v[1:]
        print(
            f"{name(v)}: CPU {c:.2f} s, wall {w:.2f} s (medians of {args.rounds}), "
            f"over before's: CPU {c / statistics.median(cpu[base]):.2f}, "
            f"wall {w / statistics.median(wall[base]):.2f}"
        )


def name(variant: tuple) -> str:
    version, workers, prune = variant
    return f"{version}, workers={workers}, prune={'on' if prune else 'off'}"


if __name__ == "__main__":
    main()
