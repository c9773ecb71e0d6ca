"""How long the planner takes: GPT-2 XL on the paper's 4-GPU server at
minibatch 64 (the issue asks for under 10 s on 2 CPU cores). Prints the
wall time, the number of candidate plans simulated, and the time per plan,
with the worker processes the machine offers and with one.

    python bench/search_speed.py [--repeats 3]
"""

import argparse
import os
import statistics
import time

import harmony


def timed(spec, hw, workers, repeats):
    times, df = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        df = harmony.search(spec, hw, 64, workers=workers)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), df


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec, hw = harmony.model_spec("gpt2-xl"), harmony.preset("paper-4x1080ti")
    print(f"cores: {os.cpu_count()}")
    for workers in (None, 1):
        t, df = timed(spec, hw, workers, args.repeats)
        n = df.attrs["simulated"]
        print(
            f"workers={workers or 'auto'}: search {t:.2f} s (median of {args.repeats}), {n} plans "
            f"simulated, {1e3 * t / n:.1f} ms per plan, {len(df)} fit; best: "
            f"{df.iloc[0].plan.describe()} {df.iloc[0].iteration_s:.2f} s/iter"
        )


if __name__ == "__main__":
    main()
