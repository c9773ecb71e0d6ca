"""The main job behind ``make figures``: plan and simulate the paper's models on
the paper's server, print the best plans, write figures and their data.

Outputs (under ``out``): ``search_<model>.csv`` (every plan that fits, ranked),
``timeline_<model>.{svg,png}`` (one iteration of the best Harmony plan, one
row per lane) with its Chrome trace, and ``swap_volume.{csv,svg,png}``
(Harmony vs the virtualized-memory baseline).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .catalog import model_spec
from .hardware import preset
from .report import format_search, format_summary
from .search import search
from .simulate import simulate

HARDWARE = "paper-4x1080ti"
QUICK = {"models": ["gpt2-xl"], "minibatches": [64]}
FULL = {"models": ["gpt2-xl", "bert-96", "vgg416", "resnet1026"], "minibatches": [16, 64, 256]}
HARMONY = ("harmony-pp", "harmony-dp")


def best_per_policy(df: pd.DataFrame) -> dict[str, pd.Series]:
    return {policy: rows.iloc[0] for policy, rows in df.groupby("policy", sort=False)}


def main_job(out: Path, quick: bool = True) -> dict:
    from .viz import bar_chart, save, timeline_chart

    cfg = QUICK if quick else FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hw = preset(HARDWARE)
    volume_rows, results = [], {}
    for name in cfg["models"]:
        spec = model_spec(name)
        for minibatch in cfg["minibatches"]:
            df = search(spec, hw, minibatch, progress=False)
            print(format_search(df, top=8), "\n")
            best = best_per_policy(df)
            harmony = min((best[p] for p in HARMONY if p in best), key=lambda r: r["iteration_s"])
            baseline = best.get("virtual-memory")
            volume_rows.append({
                "model": name, "minibatch": minibatch,
                "harmony_plan": harmony["plan"].describe(), "harmony_swap_gb": harmony["swap_gb"],
                "harmony_iteration_s": harmony["iteration_s"],
                "baseline_swap_gb": None if baseline is None else baseline["swap_gb"],
                "baseline_iteration_s": None if baseline is None else baseline["iteration_s"],
            })
            if minibatch != cfg["minibatches"][len(cfg["minibatches"]) // 2]:
                continue
            df.assign(plan=df["plan"].map(lambda p: p.to_json())).to_csv(out / f"search_{name}.csv", index=False)
            trace = simulate(spec, hw, harmony["plan"])
            print(format_summary(harmony["plan"], trace), "\n")
            trace.to_chrome(out / f"timeline_{name}.chrome.json")
            save(timeline_chart(trace, title=f"{name} on {hw.name}, minibatch {minibatch}: "
                                              f"{harmony['plan'].describe()}"), out / f"timeline_{name}")
            results[name] = {"plan": harmony["plan"].to_dict(), "summary": trace.summary,
                             "search_s": df.attrs["search_s"], "simulated": df.attrs["simulated"]}
    volume = pd.DataFrame(volume_rows)
    volume["swap_ratio"] = volume["baseline_swap_gb"] / volume["harmony_swap_gb"]
    volume.to_csv(out / "swap_volume.csv", index=False)
    print(volume.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    long = volume.melt(id_vars=["model", "minibatch"], value_vars=["harmony_swap_gb", "baseline_swap_gb"],
                       var_name="system", value_name="swap_gb")
    long["case"] = long["model"] + " / " + long["minibatch"].astype(str)
    save(bar_chart(long, "case", "swap_gb", color="system", log=True,
                   title=f"Host<->GPU bytes per iteration on {hw.name}"), out / "swap_volume")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results
