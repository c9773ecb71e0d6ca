"""Swap volume and speed of Harmony against per-layer swapping (``layer-swap``, vDNN /
LMS as those systems run it, chosen by its own rule), GPipe with swapping, and
Harmony without input-batch grouping (``harmony-no-grouping``, an ablation).

For each model (1080 Ti reference profiles) and minibatch on the paper's 4-GPU
server: Harmony's fastest plan and its least-swap plan that fits (the search
over harmony-pp and harmony-dp), each baseline by its own chooser (the largest
microbatch that fits), the ablation by the search; host<->GPU bytes per
iteration, simulated seconds, and per case the ratios against ``layer-swap``:
its bytes over Harmony's fastest and least-swap plans', its time over Harmony's
(with and without the preset's fixed cost per pack task). The computation is
the one figures 10 and 11 use (:func:`harmony.workbench.experiments.paper_grid`).

    python bench/swap_volume.py [--models gpt2-xl,bert-96] [--minibatches 16,64,256]
"""

import argparse
import time

import pandas as pd

from harmony.workbench.experiments import BASELINE, paper_grid, versus_baselines


def show(df: pd.DataFrame) -> str:
    return df.to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-xl,bert-96")
    ap.add_argument("--minibatches", default="16,64,256")
    ap.add_argument("--hardware", default="paper-4x1080ti")
    ap.add_argument("--workers", type=int, default=None, help="search processes (default: auto)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    grid = paper_grid(
        args.models.split(","),
        [int(b) for b in args.minibatches.split(",")],
        args.hardware,
        workers=args.workers,
    )
    versus = versus_baselines(grid)
    pd.set_option("display.width", 250)
    print(f"== every system's plan on {args.hardware} (simulated) ==")
    print(
        show(
            grid[
                [
                    "model",
                    "minibatch",
                    "system",
                    "plan",
                    "microbatch",
                    "fits",
                    "swap_gb",
                    "iteration_s",
                    "iteration_s_no_fixed",
                ]
            ]
        )
    )
    print("\n== Harmony against each baseline and the ablation ==")
    print(
        show(
            versus[
                [
                    "model",
                    "minibatch",
                    "baseline",
                    "role",
                    "microbatch",
                    "baseline_swap_gb",
                    "harmony_swap_gb",
                    "harmony_min_swap_gb",
                    "swap_ratio",
                    "swap_ratio_min",
                    "speedup",
                    "speedup_no_fixed",
                ]
            ]
        )
    )
    print(f"\nagainst {BASELINE} (per-layer swapping as vDNN / LMS run it):")
    for r in versus[versus.baseline == BASELINE].itertuples():
        if not r.fits:
            print(f"  {r.model} minibatch {r.minibatch}: no {BASELINE} plan fits ({r.reason})")
            continue
        print(
            f"  {r.model} minibatch {r.minibatch}: {BASELINE} (microbatch {r.microbatch}) moves "
            f"{r.swap_ratio:.2f}x the bytes of Harmony's fastest plan and {r.swap_ratio_min:.2f}x "
            f"those of its least-swap plan, and takes {r.speedup:.2f}x Harmony's time "
            f"({r.speedup_no_fixed:.2f}x without the fixed cost per pack task)"
        )
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
