"""Swap volume of the best Harmony plan vs per-layer swapping (``layer-swap``,
vDNN / LMS as those systems run it, chosen by its own rule) and vs Harmony
without input-batch grouping (``harmony-no-grouping``, an ablation).

For GPT-2 XL and BERT-96 (1080 Ti reference profiles) on the paper's 4-GPU
server at minibatch 16, 64 and 256: the search picks the fastest plan of each
policy that fits; we print their host<->GPU bytes per iteration and the ratio
(the paper reports up to two orders of magnitude). Also prints the
minimum-swap Harmony plan, since the fastest plan need not be the one that
moves the fewest bytes.

    python bench/swap_volume.py [--models gpt2-xl,bert-96] [--minibatches 16,64,256]
"""

import argparse
import time

import pandas as pd

import harmony


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-xl,bert-96")
    ap.add_argument("--minibatches", default="16,64,256")
    ap.add_argument("--hardware", default="paper-4x1080ti")
    args = ap.parse_args()
    hw = harmony.preset(args.hardware)
    rows = []
    for name in args.models.split(","):
        spec = harmony.model_spec(name)
        for mb in (int(x) for x in args.minibatches.split(",")):
            t0 = time.perf_counter()
            df = harmony.search(spec, hw, mb)
            harmony_rows = df[df.policy.isin(["harmony-pp", "harmony-dp"])]
            vm = df[df.policy == "harmony-no-grouping"]
            fastest, leanest, base = (
                harmony_rows.iloc[0],
                harmony_rows.sort_values("swap_gb").iloc[0],
                vm.iloc[0],
            )
            swap = harmony.simulate(spec, hw, harmony.plan_for("layer-swap", spec, hw, mb)).summary
            rows.append(
                {
                    "model": name,
                    "minibatch": mb,
                    "harmony_fastest": fastest.plan.describe(),
                    "harmony_swap_GB": fastest.swap_gb,
                    "harmony_iter_s": fastest.iteration_s,
                    "harmony_min_swap_GB": leanest.swap_gb,
                    "layer_swap_GB": swap.swap_bytes / 1e9,
                    "layer_swap_iter_s": swap.iteration_s,
                    "swap_ratio_vs_layer_swap": swap.swap_bytes / 1e9 / fastest.swap_gb,
                    "speedup_vs_layer_swap": swap.iteration_s / fastest.iteration_s,
                    "ablation_best": base.plan.describe(),
                    "ablation_swap_GB": base.swap_gb,
                    "swap_ratio_fastest": base.swap_gb / fastest.swap_gb,
                    "swap_ratio_min": base.swap_gb / leanest.swap_gb,
                    "speedup_vs_ablation": base.iteration_s / fastest.iteration_s,
                    "search_s": time.perf_counter() - t0,
                }
            )
            print(
                pd.DataFrame(rows[-1:]).to_string(index=False, float_format=lambda v: f"{v:.3g}"),
                flush=True,
            )
    print("\nsummary")
    print(
        pd.DataFrame(rows)
        .drop(columns=["harmony_fastest", "ablation_best"])
        .to_string(index=False, float_format=lambda v: f"{v:.3g}")
    )


if __name__ == "__main__":
    main()
