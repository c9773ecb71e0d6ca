"""Harmony against the paper's baselines as those systems run, simulated on the paper's server.

For each reference model (the 1080 Ti profiles of VGG-416, ResNet-1026,
BERT-96 and GPT-2 XL) and minibatch (16, 64, 256) on paper-4x1080ti (four
GPUs behind one PCIe switch), every plan chosen once, then simulated:

1. The baselines, each by its own chooser and stated rules
   (``harmony.planner.systems``; microbatch: the largest that fits):
   ``layer-swap`` x4 (vDNN / LMS per-layer swapping, data parallel: weights
   in per layer and microbatch, gradient sums and the optimizer on the GPU,
   swapped), ``gpipe-swap`` x4 (GPipe with the same swapping, 4 stages),
   ``karma`` x4 (its model's swap-or-recompute packs, optimizer on the host),
   ``model-parallel`` x4 (HYDRA's comparison: one stage per GPU, everything
   resident; "-" where the model does not fit the GPUs together), against
   Harmony's best plan (``harmony.search`` over harmony-pp and harmony-dp on
   4 GPUs). Printed: plan, simulated seconds per iteration and host<->GPU
   bytes, and Harmony's speedup and swap reduction against each. The preset
   charges 40 ms per pack task (the Harmony authors' time_del); per-layer
   systems run thousands of tasks, so the same plans are also simulated
   without it (``s no fixed``, ``x no fixed``).
2. KARMA against the per-layer swapping baselines (layer-swap x4 with
   activations swapped or recomputed, the next layer prefetched or loaded on
   demand), as KARMA compares itself with earlier out-of-core methods (1.52x
   on average in its paper), and where KARMA swaps and where it recomputes.

    python bench/baselines.py [--models vgg416,resnet1026,bert-96,gpt2-xl]
                              [--minibatches 16,64,256] [--jobs 2]
"""

import argparse
import dataclasses
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import pandas as pd

import harmony
from harmony import OutOfMemoryError
from harmony.planner import systems

#: the per-layer swapping baselines KARMA is compared with: name -> chooser options
LAYER_SWAP = {
    "swap+prefetch": {},
    "swap+on-demand": {"prefetch": False},
    "recompute+prefetch": {"activations": "recompute"},
    "recompute+on-demand": {"activations": "recompute", "prefetch": False},
}
BASELINES = ("layer-swap", "gpipe-swap", "karma", "model-parallel")


def plan_text(plan: harmony.Plan) -> str:
    return f"x{plan.n_gpus} u={plan.bwd_microbatch} B{len(plan.bwd_packs)}"


def timed(spec, hw, hw0, plan) -> dict:
    """Simulated seconds and swap bytes of ``plan``, and its seconds without the fixed cost."""
    s = harmony.simulate(spec, hw, plan).summary
    return {
        "s": s.iteration_s,
        "swap GB": s.swap_bytes / 1e9,
        "s no fixed": harmony.simulate(spec, hw0, plan).iteration_s,
    }


def one_case(case: tuple) -> tuple[list[dict], list[dict], float]:
    """Every system's plan for one model and minibatch, simulated: (rows, KARMA
    against the per-layer baselines, seconds it took)."""
    model, minibatch, hw, workers = case
    t0 = time.perf_counter()
    hw0 = dataclasses.replace(hw, task_overhead_s=0.0)
    spec = harmony.model_spec(model)
    found = harmony.search(
        spec, hw, minibatch, policies=harmony.policies.names("harmony"), workers=workers
    )
    best = found.iloc[0].plan
    ref = timed(spec, hw, hw0, best)
    case_of = {"model": model, "B": minibatch}
    rows = [{**case_of, "system": "harmony", "plan": f"{best.policy} {plan_text(best)}", **ref}]
    plans = {}
    for name in BASELINES:
        try:
            plans[name] = systems.CHOOSERS[name](spec, hw, minibatch)
        except OutOfMemoryError:
            rows.append({**case_of, "system": name, "plan": "does not fit"})
            continue
        rows.append(
            {
                **case_of,
                "system": name,
                "plan": plan_text(plans[name]),
                **timed(spec, hw, hw0, plans[name]),
            }
        )
    for r in rows[1:]:
        if "s" in r:
            r.update(
                {
                    "harmony x": r["s"] / ref["s"],
                    "swap / harmony": r["swap GB"] / ref["swap GB"],
                    "x no fixed": r["s no fixed"] / ref["s no fixed"],
                }
            )
    by_name = {r["system"]: r for r in rows}
    versus = []
    if "karma" in plans:
        kplan, mine = plans["karma"], by_name["karma"]
        for variant, options in LAYER_SWAP.items():
            # the faithful layer-swap plan is the first variant
            plan = (
                plans["layer-swap"]
                if not options
                else systems.choose_layer_swap(spec, hw, minibatch, **options)
            )
            t = by_name["layer-swap"] if not options else timed(spec, hw, hw0, plan)
            versus.append(
                {
                    **case_of,
                    "layer-swap": variant,
                    "its plan": plan_text(plan),
                    "s": t["s"],
                    "karma x": t["s"] / mine["s"],
                    "karma x no fixed": t["s no fixed"] / mine["s no fixed"],
                    "karma swaps": len(kplan.bwd_packs) - 1,
                    "karma recomputes": len(spec) - len(kplan.bwd_packs),
                }
            )
    return rows, versus, time.perf_counter() - t0


def geomean(values) -> float:
    values = [v for v in values if isinstance(v, float) and math.isfinite(v)]
    return math.exp(statistics.fmean(map(math.log, values))) if values else math.nan


def show(df: pd.DataFrame) -> str:
    return df.to_string(index=False, float_format=lambda x: f"{x:.3g}", na_rep="-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vgg416,resnet1026,bert-96,gpt2-xl")
    ap.add_argument("--minibatches", default="16,64,256")
    ap.add_argument("--hardware", default="paper-4x1080ti")
    ap.add_argument("--jobs", type=int, default=2, help="cases planned and simulated at once")
    args = ap.parse_args()
    hw = harmony.preset(args.hardware)
    t0 = time.perf_counter()
    cases = [
        (m, int(b), hw, 1)  # one process per case, none more for the search
        for m in args.models.split(",")
        for b in args.minibatches.split(",")
    ]
    rows, versus = [], []
    with ProcessPoolExecutor(args.jobs) as pool:
        for r, v, took in pool.map(one_case, cases):
            rows += r
            versus += v
            print(f"{r[0]['model']} B={r[0]['B']}: {took:.0f} s", flush=True)
    pd.set_option("display.width", 200)
    table = pd.DataFrame(rows)
    print(
        f"\n== Harmony vs the baselines, simulated on {hw.name} (x: baseline time / Harmony's; "
        f"'no fixed': without the preset's {hw.task_overhead_s * 1e3:.0f} ms per task) =="
    )
    print(show(table))
    print(
        "\nHarmony's speedup per baseline, geometric mean / max over the cases that fit, "
        "with and without the fixed cost; swap bytes over Harmony's:"
    )
    for name in BASELINES:
        mine = table[(table.system == name) & table["s"].notna()]
        if len(mine):
            x, x0 = mine["harmony x"], mine["x no fixed"]
            print(
                f"  {name:15s} {geomean(x):6.2f}x / {x.max():6.2f}x   {geomean(x0):6.2f}x / "
                f"{x0.max():6.2f}x   swap {geomean(mine['swap / harmony']):6.1f}x   "
                f"({len(mine)} of {len(cases)} cases)"
            )
    if versus:
        vs = pd.DataFrame(versus)
        print("\n== KARMA vs the per-layer swapping baselines (karma x: their time / KARMA's) ==")
        print(show(vs))
        print(
            f"\nKARMA over the per-layer baselines, geometric mean: "
            f"{geomean(vs['karma x']):.2f}x ({geomean(vs['karma x no fixed']):.2f}x without "
            "the fixed cost); "
            "KARMA's paper: 1.52x on average"
        )
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
