"""The explorers compute from their controls, never raise on infeasible settings,
draw charts under Altair's row limit, re-draw on changes, and the notebook runs
in batch."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("altair")

import harmony  # noqa: E402
from harmony import Plan  # noqa: E402
from harmony.costs.hardware import format_bytes  # noqa: E402
from harmony.planner.systems import (  # noqa: E402
    PLAN_MAKERS,
    choose_layer_swap,
    choose_model_parallel,
)
from harmony.policies import disk_placement, get_policy, names  # noqa: E402
from harmony.workbench import palette  # noqa: E402
from harmony.workbench.charts import MAX_ROWS, thin_memory  # noqa: E402
from harmony.workbench.comparison import (  # noqa: E402
    baselines,
    default_baseline,
    policy_choices,
)
from harmony.workbench.display import vega_script  # noqa: E402
from harmony.workbench.play import MAX_TASKS  # noqa: E402
from harmony.workbench.widgets import (  # noqa: E402
    AS_PRESET,
    CASES,
    CLAIM_APPLIES,
    CLAIM_DOES_NOT_APPLY,
    DISK_CHOICES,
    HOST_SHARES,
    NO_DISK,
    PackExplorer,
    RunForReal,
    training_state,
)

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_explorer.ipynb"


def datasets(chart) -> list[list[dict]]:
    return list(chart.to_dict()["datasets"].values())


def test_comparison_against_the_baseline():
    ex = PackExplorer(model="bert-large")
    ex.set(minibatch=32, fwd_microbatch=8, bwd_microbatch=4, pack_size=2)
    r = ex.compute()
    assert r.problem is None and r.trace.summary.fits
    df = r.comparison.set_index("policy")
    assert list(df.index) == names()  # the chosen one first, then the others in policy order
    assert df.loc["harmony-pp", "chosen"] and df.chosen.sum() == 1
    base = r.baseline
    assert base == default_baseline() == ex.baseline.value == "layer-swap"
    # the faithful baseline runs the plan its own rule picks, as vDNN / LMS would
    spec, hw = harmony.model_spec("bert-large"), harmony.preset("paper-4x1080ti")
    own = choose_layer_swap(spec, hw, 32, n_gpus=4)
    assert df.loc[base, "planned_by"] == "its own rule"
    assert df.loc[base, "bwd_microbatch"] == own.bwd_microbatch
    assert df.loc[base, "iteration_s"] == harmony.simulate(spec, hw, own).iteration_s
    # the ablation runs the controls' packs, one microbatch size (the backward one)
    ablation = names(role="ablation")[0]
    assert get_policy(ablation).PER_MICROBATCH and df.loc[ablation, "planned_by"] == "the controls"
    assert (df.loc[ablation, "fwd_microbatch"], df.loc[ablation, "bwd_microbatch"]) == (4, 4)
    assert df.loc[base, "speedup_vs_baseline"] == 1.0
    assert df.loc["harmony-pp", "speedup_vs_baseline"] == pytest.approx(
        df.loc[base, "iteration_s"] / df.loc["harmony-pp", "iteration_s"]
    )
    # the baseline moves every layer's weights for every one of its microbatches
    assert df.loc["harmony-pp", "swap_ratio_vs_baseline"] > 1
    assert df.loc["harmony-pp", "samples_per_s"] == pytest.approx(
        32 / df.loc["harmony-pp", "iteration_s"]
    )
    json.dumps(r.to_dict())


def test_packs_follow_the_plans_one_remainder_rule():
    ex = PackExplorer(model="bert-large", pack_size=3)  # 28 layers: 9 packs of 3 and one of 1
    plan = ex.compute().plan
    assert plan == Plan.uniform("harmony-pp", 4, 32, 8, 28, 3, fwd_microbatch=4)
    assert plan.bwd_packs[0] == (0, 1) and plan.bwd_packs[-1] == (25, 28)


def test_policies_and_baselines_come_from_the_registry():
    ex = PackExplorer()
    # every policy, then each faithful baseline on the controls' packs, named so
    assert list(ex.policy.options) == policy_choices()
    assert policy_choices()[: len(names())] == names()
    assert set(policy_choices()[len(names()) :]) == {f"{p} with these packs" for p in PLAN_MAKERS}
    assert list(ex.baseline.options) == baselines()
    assert not set(baselines()) & set(names(role="harmony"))
    assert default_baseline() in names(role="system")


def _simulated_speedup(setting: dict, other: Plan) -> float:
    """``other``'s simulated time over that of harmony-pp on the controls of ``setting``."""
    spec, hw = harmony.model_spec(setting["model"]), harmony.preset(setting["hardware"])
    mine = Plan.uniform(
        "harmony-pp",
        setting["n_gpus"],
        setting["minibatch"],
        setting["bwd_microbatch"],
        len(spec),
        setting["pack_size"],
        fwd_microbatch=setting["fwd_microbatch"],
    )
    return (
        harmony.simulate(spec, hw, other).iteration_s
        / harmony.simulate(spec, hw, mine).iteration_s
    )


def test_the_default_shows_the_papers_claim_against_per_layer_swapping():
    ex = PackExplorer()
    assert {k: getattr(ex, k).value for k in CLAIM_APPLIES} == CLAIM_APPLIES
    head = ex.compute().headline
    s = CLAIM_APPLIES
    spec, hw = harmony.model_spec(s["model"]), harmony.preset(s["hardware"])
    layer_swap = choose_layer_swap(spec, hw, s["minibatch"], n_gpus=s["n_gpus"])
    speedup = _simulated_speedup(s, layer_swap)
    assert speedup > 1.5  # clearly faster: the model is swapped, and Harmony swaps far less
    assert f"{speedup:.2g}x faster and " in head and "than layer-swap" in head, head
    assert "The paper's setting: the model does not fit in a GPU (19.9 GB" in head, head


def test_one_click_shows_where_the_claim_does_not_apply_and_why():
    ex = PackExplorer()
    ex.widget()
    where, where_not = ex.actions()
    assert [where.description, where_not.description] == list(CASES)
    computed, compute = [], ex.compute
    ex.compute = lambda: computed.append(1) or compute()
    where_not.click()
    assert {k: getattr(ex, k).value for k in CLAIM_DOES_NOT_APPLY} == CLAIM_DOES_NOT_APPLY
    assert len(computed) == 1  # drawn once, not once per control
    head = ex.result.headline
    s = CLAIM_DOES_NOT_APPLY
    spec, hw = harmony.model_spec(s["model"]), harmony.preset(s["hardware"])
    resident = choose_model_parallel(spec, hw, s["minibatch"], n_gpus=1)
    speedup = _simulated_speedup(s, resident)
    assert speedup < 1  # nothing needs swapping: keeping the model on the GPU is faster
    reason = "The paper's claim does not apply: the model fits in a GPU (5.36 GB"
    assert reason in head and "so nothing needs swapping" in head, head
    assert f"model-parallel, which keeps it all on the GPU, is {1 / speedup:.2g}x faster" in head
    where.click()
    assert ex.result.headline.split(". ")[-1].startswith("The paper's setting")


def test_the_headline_says_how_much_faster_and_how_many_fewer_bytes():
    r = PackExplorer(model="bert-large").compute()
    me = r.comparison.set_index("policy").loc["harmony-pp"]
    head = r.headline
    assert head.startswith(
        f"harmony-pp: {me.iteration_s:.3g} s/iter, {me.swap_gb:.3g} GB swapped: "
    )
    assert re.search(
        rf"[\d.]+x faster and [\d.]+x fewer bytes than {re.escape(r.baseline)}", head
    ), head
    assert f"{me.speedup_vs_baseline:.2g}x faster" in head
    # the baseline itself as the plan: nothing to compare with, the numbers all the same
    assert PackExplorer(policy=r.baseline).compute().headline.startswith(f"{r.baseline}: ")


def test_the_table_is_formatted_for_reading():
    # harmony-pp cannot run
    ex = PackExplorer(model="bert-large", minibatch=32, fwd_microbatch=64, bwd_microbatch=4)
    html = ex.compute().table().to_html()
    assert "nan" not in html.lower() and "None" not in html
    for heading in (
        "planned by",
        "s / iter",
        "swap GB / iter",
        "peak GB / GPU",
        "× faster",
        "why it cannot run",
    ):
        assert heading in html
    assert "fwd_microbatch=64 is larger than the minibatch (32)" in html
    r = PackExplorer(model="bert-large").compute()
    me = r.comparison.set_index("policy").loc["harmony-pp"]
    assert f">{me.iteration_s:.3g}<" in r.table().to_html()  # rounded


def test_out_of_memory_names_the_gpu_and_the_gigabytes():
    ex = PackExplorer(
        model="bert-large",
        hardware="paper-4x1080ti",
        n_gpus=1,
        minibatch=256,
        fwd_microbatch=256,
        bwd_microbatch=256,
        pack_size=14,
    )
    r = ex.compute()
    assert "gpu0" in r.problem and "GB" in r.problem and "10.74 GB" in r.problem
    assert r.trace is not None and not r.trace.summary.fits  # simulated all the same, to be seen
    texts = [row["text"] for rows in datasets(ex.chart()) for row in rows if "text" in row]
    assert any("gpu0" in t for t in texts)
    assert "does not fit: gpu0 needs 407.43 GB more" in r.headline
    shades = {
        row["policy"]: row["shade"]
        for rows in datasets(ex.chart())
        for row in rows
        if "shade" in row
    }
    assert shades["harmony-pp"] == "does not fit"  # grey, the reason in the label and the table


def test_an_invalid_plan_gives_the_validation_message_and_the_baselines():
    ex = PackExplorer(model="bert-large", minibatch=32, fwd_microbatch=64, bwd_microbatch=4)
    r = ex.compute()
    assert r.trace is None and "fwd_microbatch=64 is larger than the minibatch (32)" in r.problem
    df = r.comparison.set_index("policy")
    assert math.isnan(df.loc["harmony-pp", "iteration_s"])
    assert df.loc[r.baseline, "fits"]  # uses the backward microbatch, so it is valid
    assert df.loc["harmony-pp", "status"].startswith("not run: invalid plan")
    rows = [row for rows in datasets(ex.chart()) for row in rows]
    assert any("fwd_microbatch=64" in row.get("text", "") for row in rows)  # the problem
    assert {row["policy"] for row in rows if "label" in row} == set(names())  # the bars
    assert r.headline.startswith("harmony-pp: not run")


def test_unknown_spec_and_huge_graphs_are_reported_not_raised():
    ex = PackExplorer(model="gpt2-tiny", source="reference")
    r = ex.compute()
    assert (
        "no reference profile for 'gpt2-tiny'" in r.problem
        and r.plan is None
        and r.comparison.empty
    )
    ex.chart().to_dict()
    ex.source.value = "auto"
    ex.minibatch.value, ex.fwd_microbatch.value, ex.bwd_microbatch.value, ex.pack_size.value = (
        4096,
        1,
        1,
        1,
    )
    r = ex.compute()
    assert r.trace is None and f"{MAX_TASKS:,}" in r.problem


def test_chart_shows_the_lanes_under_the_row_limit():
    ex = PackExplorer(
        model="bert-large", n_gpus=1, minibatch=32, fwd_microbatch=1, bwd_microbatch=1, pack_size=1
    )
    r = ex.compute()
    assert len(r.trace.memory_timeline()) > MAX_ROWS  # the memory chart has to be thinned
    spec = ex.chart().to_dict()
    rows = list(spec["datasets"].values())
    assert all(len(d) <= MAX_ROWS for d in rows)
    lanes = {row["lane"] for d in rows for row in d if "lane" in row}
    assert lanes == set(r.trace.timeline.lane) and "gpu0.compute" in lanes
    assert {row["policy"] for d in rows for row in d if "policy" in row} == set(harmony.POLICIES)
    assert " ".join(spec["title"]["text"]) == " ".join(r.headlines)  # wrapped


def test_thinned_memory_keeps_the_peaks():
    r = PackExplorer(
        model="bert-large", n_gpus=2, minibatch=32, fwd_microbatch=1, bwd_microbatch=1, pack_size=1
    ).compute()
    thin = thin_memory(r.trace, 500)
    assert sum(len(s) for s in thin.memory.values()) <= 500
    for device, steps in r.trace.memory.items():
        assert max(b for _, b in thin.memory[device]) == max(b for _, b in steps)
        assert thin.memory[device][-1][1] == steps[-1][1]


def test_controls_stay_consistent():
    ex = PackExplorer(model="bert-large", hardware="paper-4x1080ti")
    assert ex.n_gpus.max == 4 and ex.pack_size.max == 28
    ex.hardware.value = "h100-pcie5"
    assert ex.n_gpus.value == ex.n_gpus.max == 1
    ex.model.value = "gpt2-tiny"
    assert ex.pack_size.max < 28
    ex.policy.value = next(p for p in names() if get_policy(p).PER_MICROBATCH)
    assert ex.fwd_microbatch.disabled
    ex.fwd_microbatch.value, ex.bwd_microbatch.value = 8, 2
    plan = ex.compute().plan
    assert plan.fwd_microbatch == plan.bwd_microbatch == 2


def test_changing_a_control_redraws_the_output():
    ex = PackExplorer(model="bert-large", minibatch=16)
    assert not ex.output.outputs  # nothing is computed before the widget is shown
    ex.widget()
    first = ex.output.outputs
    html = first[0]["data"]["text/html"]
    assert "vegaEmbed" in html and "data:image/svg+xml" not in html  # live: no picture
    # the table under the chart, in the same output: they appear together
    assert html.index('class="harmony-chart"') < html.index("<table") < html.index("<script")
    ex.pack_size.value = 4
    assert ex.output.outputs != first and ex.result.plan.bwd_packs[0] == (0, 4)
    assert len(ex.output.outputs) == 1  # replaced, not appended
    assert "application/vnd.jupyter.widget-view+json" in ex._repr_mimebundle_()


# ---- host memory and the disk tier -------------------------------------------------------
def _color_scales(node) -> list[dict]:
    """Every colour scale with a domain in a vega-lite spec."""
    found = []
    if isinstance(node, dict):
        scale = node.get("scale")
        if isinstance(scale, dict) and "domain" in scale and "range" in scale:
            found.append(scale)
        for value in node.values():
            found += _color_scales(value)
    elif isinstance(node, list):
        for value in node:
            found += _color_scales(value)
    return found


def test_by_default_the_server_is_the_presets():
    ex = PackExplorer(model="bert-large")
    assert (ex.host_memory.value, ex.disk.value) == (AS_PRESET, NO_DISK)
    assert list(ex.host_memory.options)[0] == ("as the preset (750 GB)", AS_PRESET)
    assert [v for _, v in ex.host_memory.options] == [AS_PRESET, *HOST_SHARES]
    assert [v for _, v in ex.disk.options] == list(DISK_CHOICES.values())
    assert ex.host_memory in ex.controls() and ex.disk in ex.controls()
    r = ex.compute()
    # every row played on the preset itself: the same comparison as its host memory given
    hw = harmony.preset("paper-4x1080ti")
    same = PackExplorer(model="bert-large", host_memory=hw.host_memory).compute()
    pd.testing.assert_frame_equal(r.comparison, same.comparison)
    spec = harmony.model_spec("bert-large")
    assert r.trace.iteration_s == harmony.simulate(spec, hw, r.plan).iteration_s
    assert (r.comparison.disk_gb.dropna() == 0).all()
    assert "DISK_IN" not in set(r.trace.timeline.kind)
    # nothing about the server in the headline, nor a disk column in the table
    assert r.tiers == "" and len(r.headlines) == 2 and "disk" not in r.headline
    assert "disk GB" not in r.table().to_html()
    # ... which says where the state lives once the server is set, even as the preset's
    assert same.tiers == "On paper-4x1080ti with 750 GB of host memory and no disk: " + (
        "the training state stays in host memory"
    )


def test_a_host_too_small_without_a_disk_says_what_to_set():
    ex = PackExplorer(host_memory="75%")  # BERT-96: 14.9 GB for 19.9 GB of state
    r = ex.compute()
    spec = harmony.model_spec(CLAIM_APPLIES["model"])
    short = int(0.75 * training_state(spec))
    assert training_state(spec) == pytest.approx(19.87e9, rel=1e-3)
    assert r.trace is None and r.problem.startswith("host memory: harmony-pp on 'paper-4x1080ti'")
    # what to change, said with the explorer's own controls, not the command line's flags
    assert f"host memory is {format_bytes(short)}" in r.problem
    assert r.problem.endswith(": raise host memory or pick a disk in the controls above")
    assert "--" not in r.problem and "Hardware." not in r.problem
    df = r.comparison.set_index("policy")
    # every row on the same server: the baseline keeps its state in host memory too
    assert df.loc[r.baseline, "status"].startswith("not run: host memory")
    assert df.loc["model-parallel", "fits"]  # its state stays on its GPUs
    server = f"with {format_bytes(short)} of host memory (75% of the training state) and no disk"
    assert server in r.headline
    texts = [row["text"] for rows in datasets(ex.chart()) for row in rows if "text" in row]
    drawn = " ".join(t.replace("\n", " ") for t in texts)  # the problem, drawn
    assert "pick a disk in the controls above" in drawn
    # the widget shows it without a chart: the message, then the table of every policy
    ex.widget()
    [shown] = [o["data"]["text/html"] for o in ex.output.outputs]
    assert "harmony-chart" not in shown and "vegaEmbed" not in shown
    said = shown.index("raise host memory or pick a disk in the controls above")
    assert said < shown.index("<table")


def test_with_a_disk_the_state_goes_there_and_the_timeline_shows_it():
    ex = PackExplorer(host_memory="75%", disk="nvme")
    r = ex.compute()
    assert r.problem is None and r.trace.summary.fits
    spec = harmony.model_spec(CLAIM_APPLIES["model"])
    hw = harmony.preset("paper-4x1080ti")
    hw = hw.with_host_memory(int(0.75 * training_state(spec))).with_disk("nvme")
    placement = disk_placement(spec, hw, r.plan)
    moved = [q for q, kind in placement.on_disk if kind == "optimizer"]
    assert 0 < len(moved) == len(placement.on_disk) < len(r.plan.bwd_packs)
    s = r.trace.summary
    # the placement the graph's disk tasks follow: each pack's state written back once
    assert s.disk_write_bytes == placement.write_bytes_per_step
    kinds = set(r.trace.timeline.kind)
    assert {"DISK_IN", "DISK_OUT"} <= kinds
    said = (
        f"on disk the optimizer state of {len(moved)} of the {len(r.plan.bwd_packs)} backward "
        f"packs ({format_bytes(placement.disk_bytes)}), {format_bytes(s.disk_bytes)} read and "
        "written per iteration"
    )
    assert said in r.tiers and said in r.headline and r.to_dict()["tiers"] == r.tiers
    assert "over a disk reading 7 GB/s and writing 5 GB/s" in r.headline
    assert r.headlines[-1].startswith("The paper's setting")
    # the disk's bytes apart from the swap: the same host<->GPU bytes as with memory to spare
    df = r.comparison.set_index("policy")
    assert df.loc["harmony-pp", "disk_gb"] == pytest.approx(s.disk_bytes / 1e9)
    roomy = harmony.simulate(spec, harmony.preset("paper-4x1080ti"), r.plan).summary
    assert s.swap_bytes == roomy.swap_bytes and s.disk_bytes > 0 == roomy.disk_bytes
    assert "disk GB / iter" in r.table().to_html()
    chart = ex.chart().to_dict()
    rows = [row for d in chart["datasets"].values() for row in d]
    assert all(len(d) <= MAX_ROWS for d in chart["datasets"].values())
    lanes = {row["lane"] for row in rows if "lane" in row}
    assert {"host.disk_read", "host.disk_write"} <= lanes
    assert {row["kind"] for row in rows if row.get("lane") == "host.disk_read"} == {"DISK_IN"}
    assert {row["kind"] for row in rows if row.get("lane") == "host.disk_write"} == {"DISK_OUT"}
    # in the palette's colours, as notebook 20 draws them
    scale = next(sc for sc in _color_scales(chart) if "DISK_IN" in sc["domain"])
    colors = dict(zip(scale["domain"], scale["range"]))
    assert colors["DISK_IN"] == palette.kind_color("DISK_IN")
    assert colors["DISK_OUT"] == palette.kind_color("DISK_OUT")
    assert "host.disk_read: disk → host" in json.dumps(chart, ensure_ascii=False)
    assert "not the disk's" in json.dumps(chart, ensure_ascii=False)  # the swap bars say so


def test_set_host_memory_and_disk():
    ex = PackExplorer(model="bert-large")
    ex.widget()
    first = ex.result
    computed, compute = [], ex.compute
    ex.compute = lambda: computed.append(1) or compute()
    ex.set(host_memory="75%", disk="1GB/s,1GB/s")  # a disk not offered: added
    assert len(computed) == 1  # drawn once
    assert (ex.host_memory.value, ex.disk.value) == ("75%", "1GB/s,1GB/s")
    assert ("1GB/s,1GB/s", "1GB/s,1GB/s") in ex.disk.options
    r = ex.result
    assert r.problem is None and "DISK_IN" in set(r.trace.timeline.kind)
    assert "over a disk reading 1 GB/s and writing 1 GB/s: on disk the optimizer state" in (
        r.headline
    )
    slower = r.trace.iteration_s
    ex.set(disk="1GB/s,1GB/s,shared")  # the same disk, its reads and writes taking turns
    assert "writing 1 GB/s (one at a time): on disk" in ex.result.headline
    assert ex.result.trace.iteration_s > slower
    ex.set(disk="nvme")
    assert ex.result.trace.iteration_s < slower  # a faster disk hides more
    ex.set(host_memory="4GiB")  # a size not offered: added, labelled
    assert ex.host_memory.value == "4GiB" and ex.host_memory.label == "4GiB (4.29 GB)"
    assert "with 4.29 GB of host memory over a disk" in ex.result.headline
    ex.set(host_memory="lots")
    assert "cannot read host memory 'lots'" in ex.result.problem
    ex.set(host_memory=None, disk=None)  # back to the preset's
    assert (ex.host_memory.value, ex.disk.value) == (AS_PRESET, NO_DISK)
    assert ex.result.tiers == "" and ex.result.headline == first.headline
    # the shares are labelled with their sizes for the model chosen
    ex.set(model="gpt2-xl")
    spec = harmony.model_spec("gpt2-xl")
    share = f"75% of the training state ({format_bytes(int(0.75 * training_state(spec)))})"
    assert (share, "75%") in ex.host_memory.options and ex.host_memory.value == AS_PRESET


def test_run_for_real_next_to_the_simulation():
    real = RunForReal(minibatch=8, fwd_microbatch=4, bwd_microbatch=2, pack_size=2, steps=2)
    r = real.compute()
    assert r.problem is None and len(r.losses) == 2 and all(math.isfinite(x) for x in r.losses)
    sim, run = r.simulated.timeline, r.measured.timeline
    assert len(sim) == len(run) and list(sim.columns) == list(run.columns)
    assert sorted(sim.kind) == sorted(run.kind)
    assert list(r.comparison.executor) == ["simulated", "measured"]
    assert r.comparison.swap_mb.iloc[0] == pytest.approx(r.comparison.swap_mb.iloc[1])
    spec = real.chart().to_dict()
    assert len(spec["vconcat"]) == 2 and all(len(d) <= MAX_ROWS for d in spec["datasets"].values())
    json.dumps(r.to_dict())


def test_run_for_real_reports_a_device_too_small():
    real = RunForReal(memory="100KB", steps=1)
    r = real.compute()
    assert r.measured is None and "out of memory" in r.problem
    real.memory.value = "lots"
    assert "cannot read emulated device memory" in real.compute().problem
    real.chart().to_dict()


@pytest.mark.skipif(
    importlib.util.find_spec("papermill") is None, reason="papermill is not installed"
)
def test_notebook_runs_in_batch(executed_notebook):
    """The explorer's notebook run by papermill (the run the notebook tests check too):
    what it writes is the widgets' results, and figures of them."""
    out = executed_notebook(NOTEBOOK).out
    results = json.loads((out / "results.json").read_text())
    assert results["explorer"]["problem"] is None and len(
        results["explorer"]["comparison"]
    ) == len(harmony.POLICIES)
    assert len(results["run_for_real"]["losses"]) == 2
    assert results["explorer"]["setting"].startswith("The paper's setting")
    assert results["claim_does_not_apply"]["setting"].startswith(
        "The paper's claim does not apply"
    )
    for name in ("explorer", "run_for_real"):
        for suffix in ("svg", "png"):
            assert (out / f"{name}.{suffix}").stat().st_size > 1000


def test_a_host_too_small_for_the_stashes_puts_them_on_disk_too():
    """GPT-2 XL at 30% of its training state over NVMe: with all its optimizer state
    on disk, the stashes go too, and the headline says so with their bytes."""
    ex = PackExplorer(model="gpt2-xl", host_memory="30%", disk="nvme")
    r = ex.compute()
    assert r.problem is None and r.trace.summary.fits
    spec = harmony.model_spec("gpt2-xl")
    hw = harmony.preset("paper-4x1080ti")
    hw = hw.with_host_memory(int(0.30 * training_state(spec))).with_disk("nvme")
    placement = disk_placement(spec, hw, r.plan)
    assert placement.stashes_on_disk
    said = f"and the stashes ({format_bytes(placement.stash_disk_bytes)})"
    assert said in r.tiers and said in r.headline
    assert r.trace.summary.disk_write_bytes == placement.write_bytes_per_step


# ---- behaviour of the live widget --------------------------------------------------------------
def _updates(explorer) -> list:
    """The outputs the widget's output area is given, one entry per replacement."""
    seen: list = []
    explorer.output.observe(lambda change: seen.append(change["new"]), "outputs")
    return seen


def test_every_change_replaces_the_output_once():
    ex = PackExplorer(model="gpt2-tiny", minibatch=8, fwd_microbatch=2, bwd_microbatch=2)
    ex.widget()
    seen = _updates(ex)
    for name, value in [("pack_size", 1), ("hardware", "h100-pcie5"), ("model", "bert-tiny")]:
        seen.clear()
        getattr(ex, name).value = value
        assert len(seen) == 1, f"{name}: the output changed {len(seen)} times, not once"
        assert len(seen[0]) == 1 and "harmony-chart" in seen[0][0]["data"]["text/html"]
        # the chart brings no vega script of its own: the widget loads it once, beside it
        assert len(seen[0][0]["data"]["text/html"]) < len(vega_script()) / 4
    loader = ex.widget().children[-1]
    assert "window.vegaEmbed" in loader.outputs[0]["data"]["text/html"]


def test_going_back_to_a_setting_shows_it_again_without_computing_it():
    ex = PackExplorer(model="gpt2-tiny", minibatch=8, fwd_microbatch=2, bwd_microbatch=2)
    ex.widget()
    first, computed, compute = ex.output.outputs, [], ex.compute
    ex.compute = lambda: computed.append(1) or compute()
    ex.pack_size.value = 1
    assert len(computed) == 1 and ex.output.outputs != first
    ex.pack_size.value = 2
    assert len(computed) == 1 and ex.output.outputs == first and ex.result.plan.bwd_packs


def test_a_hardware_change_keeps_the_gpus_where_it_can():
    ex = PackExplorer(model="gpt2-tiny", minibatch=8, fwd_microbatch=2, bwd_microbatch=2)
    assert ex.n_gpus.value == 4
    ex.hardware.value = "h100-pcie5"  # one GPU
    assert ex.n_gpus.value == ex.n_gpus.max == 1
    assert "On 1 GPU, not 4: h100-pcie5 has 1" in ex.compute().headline
    ex.hardware.value = "paper-8x1080ti"
    assert (ex.n_gpus.value, ex.n_gpus.max) == (4, 8)  # back to what the reader asked for
    assert "not 4" not in ex.compute().headline
    ex.n_gpus.value = 8
    ex.hardware.value = "paper-4x1080ti"
    assert ex.n_gpus.value == 4
    ex.n_gpus.value = 2  # the reader's choice from now on
    ex.hardware.value = "paper-8x1080ti"
    assert ex.n_gpus.value == 2


def test_a_baseline_by_name_runs_as_the_system_does_and_on_these_packs_as_a_variant():
    ex = PackExplorer(model="bert-large", policy="layer-swap")
    r = ex.compute()
    spec, hw = harmony.model_spec("bert-large"), harmony.preset("paper-4x1080ti")
    assert r.plan == choose_layer_swap(spec, hw, CLAIM_APPLIES["minibatch"], n_gpus=4)
    df = r.comparison.set_index("policy")
    mine = df.loc["layer-swap"]
    assert mine.chosen and mine.planned_by == "its own rule"
    assert mine.iteration_s == r.trace.iteration_s  # the number the table shows
    assert r.headline.startswith(f"layer-swap: {r.trace.iteration_s:.3g} s/iter")
    assert "layer-swap as the system runs it: its own chooser's plan" in r.headline
    assert "'layer-swap with these packs' runs it on those" in r.headline
    ex.policy.value = "layer-swap with these packs"
    r = ex.compute()
    assert r.plan == ex.plan_for("layer-swap", 4, len(spec))
    df = r.comparison.set_index("policy")
    assert df.loc["layer-swap with these packs", "planned_by"] == "the controls"
    assert df.loc["layer-swap", "planned_by"] == "its own rule"  # the system itself, beside it
    assert df.loc["layer-swap with these packs", "chosen"] and df.chosen.sum() == 1
    assert "layer-swap on the packs and microbatches of the controls" in r.headline


def test_the_case_buttons_are_as_wide_as_their_labels():
    assert all(b.layout.width == "auto" for b in PackExplorer(model="gpt2-tiny").actions())


def test_run_for_real_says_what_it_is_doing_before_its_result():
    real = RunForReal(minibatch=4, fwd_microbatch=2, bwd_microbatch=2, steps=1)
    real.widget()
    seen = _updates(real)
    real.run_button.click()
    html = [o[0]["data"]["text/html"] for o in seen]
    assert "Running for real: building gpt2-tiny" in html[0]
    assert any("engine step 1 of 1" in h for h in html)
    assert "harmony-chart" in html[-1] and not real.run_button.disabled


def test_a_plan_that_swaps_next_to_nothing_gets_no_ratio_of_bytes():
    from harmony.workbench.comparison import NO_SWAP_GB, headline, versus

    df = pd.DataFrame(
        {
            "policy": ["layer-swap", "model-parallel", "harmony-pp"],
            "iteration_s": [10.0, 4.0, 2.0],
            "swap_gb": [64.0, 64.0 / 645747.51, 8.0],
            "fits": [True, True, True],
            "status": ["", "", ""],
        }
    )
    rows = versus(df, "layer-swap").set_index("policy")
    assert 64.0 / 645747.51 < NO_SWAP_GB and math.isnan(
        rows.loc["model-parallel", "swap_ratio_vs_baseline"]
    )
    assert rows.loc["harmony-pp", "swap_ratio_vs_baseline"] == 8.0
    text = headline(versus(df, "layer-swap"), "model-parallel", "layer-swap")
    assert text == (
        "model-parallel: 4 s/iter, next to nothing swapped: 2.5x faster than layer-swap; "
        "fastest that fits: harmony-pp at 2 s/iter"
    )
