"""How long the planner takes: GPT-2 XL on the paper's 4-GPU server at
minibatch 64 (the explorer needs it in at most 5 s with 2 workers). Prints the
wall time, the CPU time (of this process, and of the worker processes), the
number of candidate plans simulated, and the time per plan,
with the worker processes the machine offers and with one, simulating every
candidate and pruning those that cannot reach the top (``search(prune=True)``;
the top plans and their times are the same); then the time to simulate the best
plan alone (build its graph, play it: what a control of the explorer costs), wall
and CPU time, median of ``--repeats``. (``bench/search_versions.py`` and
``bench/build_speed.py`` compare these with an older version of the code.)

    python bench/search_speed.py [--repeats 3] [--workers auto,1] [--prune off,on]
"""

import argparse
import os
import statistics
import time

from cpu_quota import cpu_quota
from search_versions import cpu_seconds

import harmony
from harmony.policies import build_graph
from harmony.simulate import play, simulate_graph


def timed(spec, hw, workers, repeats, prune):
    """Median wall and CPU seconds of the search (the CPU time of this process and
    of its worker processes together), and its DataFrame."""
    times, cpu, df = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), cpu_seconds()
        df = harmony.search(spec, hw, 64, workers=workers, prune=prune)
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
    return statistics.median(times), statistics.median(cpu), df


def one_plan(spec, hw, plan, repeats) -> str:
    """Median milliseconds (wall, CPU) to build ``plan``'s graph, to play it, and
    to simulate it from scratch (build, play and summary)."""
    steps = {
        "build": lambda: build_graph(spec, hw, plan),
        "play": lambda: play(graph),
        "build+play+summary": lambda: simulate_graph(build_graph(spec, hw, plan)).summary,
    }
    graph = build_graph(spec, hw, plan)
    out = []
    for name, step in steps.items():
        wall, cpu = [], []
        for _ in range(max(5, repeats)):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out.append(
            f"{name} {1e3 * statistics.median(wall):.1f} ms "
            f"(CPU {1e3 * statistics.median(cpu):.1f} ms)"
        )
    return f"{len(graph.tasks)} tasks: " + ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--workers", default="auto,1", help="worker counts, comma-separated (auto: the default)"
    )
    ap.add_argument("--prune", default="off,on", help="off and/or on, comma-separated")
    ap.add_argument(
        "--cpus", type=float, help="a model of a slower machine (bench/cpu_quota.py), e.g. 0.5"
    )
    args = ap.parse_args()
    with cpu_quota(args.cpus):
        run(args)


def run(args) -> None:
    counts = [None if w == "auto" else int(w) for w in args.workers.split(",")]
    prunes = [{"off": False, "on": True}[p] for p in args.prune.split(",")]
    spec, hw = harmony.model_spec("gpt2-xl"), harmony.preset("paper-4x1080ti")
    print(f"cores: {os.cpu_count()}")
    for workers in counts:
        for prune in prunes:
            t, cpu, df = timed(spec, hw, workers, args.repeats, prune)
            n = df.attrs["simulated"]
            print(
                f"workers={workers or 'auto'} prune={'on' if prune else 'off'}: search {t:.2f} s "
                f"(median of {args.repeats}; CPU {cpu:.2f} s, the workers' too), {n} plans "
                f"simulated ({df.attrs.get('pruned', 0)} pruned), {1e3 * t / n:.1f} ms per plan, "
                f"{len(df)} fit; best: "
                f"{df.iloc[0].plan.describe()} {df.iloc[0].iteration_s:.2f} s/iter"
            )
    plan = df.iloc[0].plan
    print(f"one plan, {plan.describe()}: {one_plan(spec, hw, plan, args.repeats)}")


if __name__ == "__main__":
    main()
