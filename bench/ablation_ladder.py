"""The ablation ladder: from per-layer swapping to Harmony, one technique at a time.

Per model (1080 Ti reference profiles) at one minibatch on the paper's 4-GPU
server, simulated: per-layer swapping on demand with gradient sums and the
optimizer on the GPU (``layer-swap``, its own chooser's microbatch), then
Harmony's packs (and microbatch), prefetch, the CPU update overlapped with
backward, input-batch grouping, p2p between GPUs (the pipeline) and the
recompute overlap, each rung a plan of an existing policy and options
(:data:`harmony.workbench.experiments.RUNGS`). Printed per rung: seconds per
iteration, speedup over the rung below and over the bottom (and over the bottom
without the preset's fixed cost per pack task), and the PCIe GB per iteration
(host<->GPU, GPU<->GPU). The computation is figure 19's
(:func:`harmony.workbench.experiments.ablation_ladder`).

    python bench/ablation_ladder.py [--models bert-96,gpt2-xl,vgg416,resnet1026] [--minibatch 64]
"""

import argparse
import time

import pandas as pd

from harmony.workbench.experiments import PAPER_MODELS, ablation_ladder, ladder_claims


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(PAPER_MODELS))
    ap.add_argument("--minibatch", type=int, default=64)
    ap.add_argument("--hardware", default="paper-4x1080ti")
    ap.add_argument("--workers", type=int, default=None, help="search processes (default: auto)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ladder = ablation_ladder(args.models.split(","), args.minibatch, args.hardware, args.workers)
    claims = ladder_claims(ladder)
    pd.set_option("display.width", 250)
    columns = {
        "rung": "rung",
        "technique": "technique",
        "microbatch": "u",
        "iteration_s": "s/iter",
        "speedup_vs_previous": "x prev",
        "speedup_vs_bottom": "x bottom",
        "speedup_no_fixed_vs_bottom": "x bottom no fixed",
        "host_gpu_gb": "host<->GPU GB",
        "gpu_gpu_gb": "GPU<->GPU GB",
    }
    for model, rows in ladder.groupby("model", sort=False):
        print(f"== {model}, minibatch {args.minibatch}, {args.hardware} (simulated) ==")
        if "rung" not in rows or rows["rung"].isna().all():
            print(f"  no ladder: {rows['reason'].iloc[0]}")
            continue
        print(
            rows[list(columns)]
            .rename(columns=columns)
            .to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-")
        )
        mine = claims["per_model"][model]
        print(
            f"  Harmony-PP over the bottom rung: {mine['total_speedup']:.2f}x "
            f"({mine['total_speedup_no_fixed']:.2f}x without the fixed cost); largest step: "
            f"{mine['largest_step']} (x{mine['largest_step_speedup']:.2f})\n"
        )
    print(
        f"over the models: up to {claims['max_total_speedup']:.2f}x, geometric mean "
        f"{claims['geomean_total_speedup']:.2f}x ({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
