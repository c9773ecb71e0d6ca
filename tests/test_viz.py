"""Charts are built from traces without a browser, stay under Altair's row limit, take
their colours from one palette, and display without internet."""

import json
import re

import pandas as pd
import pytest

pytest.importorskip("altair")

import harmony  # noqa: E402
from harmony.graph import COMPUTE_KINDS, TRANSFER_KINDS  # noqa: E402
from harmony.plan import Plan, uniform_packs  # noqa: E402
from harmony.policies import names  # noqa: E402
from harmony.workbench import charts, display, palette, timelines  # noqa: E402
from harmony.workbench.charts import (  # noqa: E402
    MAX_ROWS,
    bar_chart,
    coalesce,
    loss_chart,
    memory_chart,
    timeline_chart,
)


def _trace(minibatch=64, u=1):
    spec = harmony.model_spec("bert-large")
    packs = uniform_packs(0, len(spec), 2)
    plan = Plan("harmony-no-grouping", 4, minibatch, u, u, packs[:-1], packs)
    return harmony.simulate(spec, harmony.preset("paper-4x1080ti"), plan)


def test_large_traces_are_aggregated_not_truncated():
    trace = _trace()
    assert len(trace.timeline) > MAX_ROWS
    small = coalesce(trace.timeline)
    assert len(small) <= MAX_ROWS
    assert small.tasks.sum() == len(trace.timeline)  # every task is behind some bar
    assert abs(small.bytes.sum() - trace.timeline.bytes.sum()) < 1e-6 * trace.timeline.bytes.sum()
    spec = timeline_chart(trace).to_dict()
    rows = next(iter(spec["datasets"].values()))
    assert len(rows) <= MAX_ROWS
    assert {r["lane"] for r in rows} == set(trace.timeline.lane)


def test_small_traces_keep_one_bar_per_task():
    trace = _trace(minibatch=4, u=4)
    assert len(coalesce(trace.timeline)) == len(trace.timeline)
    memory = memory_chart(trace).to_dict()
    assert len(memory["spec"]["layer"]) == 3  # band, its top, the capacity
    rows = next(iter(memory["datasets"].values()))
    assert len(rows) == timelines.MEMORY_BINS * len(trace.memory)  # a band, not a comb
    peak = max(trace.summary.peak_memory.values()) / 1e9
    assert max(r["high_gb"] for r in rows) == pytest.approx(peak)  # the peak stays


# ---- one palette ----------------------------------------------------------------------------
def test_every_task_kind_has_a_colour_and_words():
    kinds = COMPUTE_KINDS | TRANSFER_KINDS
    assert kinds <= set(palette.KIND_COLORS) and kinds <= set(palette.KIND_WORDS)
    assert len(set(palette.KIND_COLORS.values())) == len(palette.KIND_COLORS)
    assert palette.KIND_WORDS["W_IN"] == "weights host → GPU"


def test_every_policy_has_its_own_colour_in_every_chart():
    colors = palette.policy_colors()
    assert list(colors) == names() and len(set(colors.values())) == len(colors)
    df = pd.DataFrame(
        {"case": ["a", "a", "b"], "policy": [names()[1], names()[0], names()[0]], "v": [1, 2, 3]}
    )
    spec = bar_chart(df, "case", "v", "policy").to_dict()
    scale = spec["spec"]["layer"][0]["encoding"]["color"]["scale"]
    assert scale["domain"] == names()[:2] and scale["range"] == [colors[p] for p in names()[:2]]
    assert palette.color("harmony.Engine") == colors[names("harmony")[0]]
    assert palette.color("some other series") == palette.color("some other series")


def test_timeline_legend_says_what_each_kind_is():
    spec = timeline_chart(_trace(minibatch=4, u=4), subtitle="packs").to_dict()
    bars = spec["layer"][1]  # over the GPUs' shaded bands
    legend = bars["encoding"]["color"]["legend"]
    assert "weights host → GPU" in legend["labelExpr"]
    assert bars["encoding"]["color"]["scale"]["range"][0] == palette.KIND_COLORS["FWD"]
    assert (
        spec["title"]["subtitle"][0] == "packs"
        and "h2d: host → GPU" in spec["title"]["subtitle"][1]
    )
    assert any(p.get("bind") == "scales" for p in _params(spec))  # zoom and pan in time


def _params(spec: dict) -> list[dict]:
    return spec.get("params", []) + [p for layer in spec.get("layer", []) for p in _params(layer)]


def test_many_lanes_are_grouped_by_gpu_wide_enough_and_can_be_picked():
    trace = _trace(minibatch=8, u=4)  # 4 GPUs: 4 lanes each and the CPU's
    spec = timeline_chart(trace, width=600).to_dict()
    rows = [r for d in spec["datasets"].values() for r in d]
    bars = [r for r in rows if "kind" in r]
    tasks = trace.timeline
    span = tasks.end_s.max() - tasks.start_s.min()
    shortest = min(r["drawn_end_s"] - r["start_s"] for r in bars)
    assert shortest >= span * timelines.MIN_BAR_PX / 600 * (1 - 1e-9)
    assert (tasks.end_s - tasks.start_s).min() < shortest  # short tasks were widened
    shades = {r["lane"]: r["band"] for r in rows if "band" in r}
    assert shades["gpu0.compute"] == shades["gpu0.h2d"] != shades["gpu1.compute"]
    menu = next(p for p in _params(spec) if "bind" in p and p["bind"] != "scales")
    assert {"all", "gpu0", "gpu3", "h2d", "cpu"} <= set(menu["bind"]["options"])
    picked = timeline_chart(trace, lanes=["gpu1", "cpu"]).to_dict()
    lanes = {r["lane"] for d in picked["datasets"].values() for r in d if "kind" in r}
    assert lanes and all(lane.startswith(("gpu1.", "cpu")) for lane in lanes)
    with pytest.raises(harmony.HarmonyError, match="pick lanes from"):
        timeline_chart(trace, lanes=["gpu9"])


def test_loss_chart_draws_the_engine_dashed_over_the_plain_loop():
    losses = pd.DataFrame({"step": [0, 1], "engine": [2.0, 1.5], "reference": [2.0, 1.5]})
    layers = loss_chart(losses).to_dict()["layer"]
    assert len(layers) == 2  # solid first, dashed on top
    assert layers[0]["mark"]["strokeWidth"] > layers[1]["mark"]["strokeWidth"]
    dash = layers[0]["encoding"]["strokeDash"]["scale"]
    assert dash["domain"] == ["plain PyTorch loop", "harmony.Engine"] and dash["range"][0] == [
        1,
        0,
    ]


# ---- display without internet --------------------------------------------------------------
def _small_chart():
    import altair as alt

    return (
        alt.Chart(pd.DataFrame({"x": ["a", "b"], "y": [1, 2]}), title="t")
        .mark_bar()
        .encode(x="x", y="y")
    )


def test_interactive_html_needs_no_network_and_carries_a_picture():
    bundle = display.mimebundle(_small_chart().to_dict())
    html = bundle["text/html"]
    assert "window.vegaEmbed" in html and "data:image/svg+xml;base64," in html
    assert "cdn.jsdelivr" not in html and "<script src" not in html
    assert not re.search(r'(src|href)="https?://', html)
    assert bundle["text/plain"] == "<chart: t>"
    live = display.mimebundle(_small_chart().to_dict(), picture=False)["text/html"]
    assert "data:image/svg+xml" not in live
    # importing the charts switches the renderer, and they keep its API importable
    assert charts.mimebundle is display.mimebundle and charts.use_renderer is display.use_renderer


def test_charts_with_many_data_rows_are_drawn_on_a_canvas_with_the_export_menu():
    import altair as alt

    many = display.CANVAS_FROM_ROWS
    frame = pd.DataFrame({"x": range(many), "y": range(many)})
    big = alt.layer(alt.Chart(frame).mark_bar().encode(x="x", y="y"), _small_chart())
    assert display.data_rows(big.to_dict()) == many + 2
    options = {
        name: json.loads(re.search(r"vegaEmbed\(live, .*, (\{.*\})\)\s*$", html, re.M)[1])
        for name, html in (
            ("small", display.live_bundle(_small_chart())["text/html"]),
            ("big", display.live_bundle(big)["text/html"]),
        )
    }
    assert options["small"]["renderer"] == "svg" and options["big"]["renderer"] == "canvas"
    assert options["small"]["actions"] == options["big"]["actions"]
    assert options["big"]["actions"]["export"] is True  # PNG and SVG, drawn from the view
    # inline values of concatenated parts count too
    inline = {"vconcat": [{"data": {"values": [{"a": 1}] * 3}}, {"layer": [{}]}]}
    assert display.data_rows(inline) == 3


def test_the_renderer_switch(monkeypatch):
    import altair as alt

    try:
        assert (
            display.use_renderer() == "interactive"
            and alt.renderers.active == "harmony-interactive"
        )
        html = _small_chart()._repr_mimebundle_()
        html = html[0] if isinstance(html, tuple) else html
        assert "window.vegaEmbed" in html["text/html"]
        monkeypatch.setenv(display.RENDERER_ENV, "static")
        assert display.use_renderer() == "static"
        static = display.Displayable(_small_chart())._repr_mimebundle_()["text/html"]
        assert "<script" not in static and "<img" in static
        assert display.use_renderer("altair") == "altair" and not alt.renderers.active.startswith(
            "harmony"
        )
        with pytest.raises(harmony.HarmonyError, match="unknown chart renderer 'fancy'"):
            display.use_renderer("fancy")
    finally:
        display.use_renderer("interactive")


# ---- every chart the library makes, judged as a reader would -------------------------------
def _grid():
    systems = ["harmony", "harmony (least swap)", "harmony-pp", "harmony-dp", "layer-swap"]
    systems += ["gpipe-swap", "harmony-no-grouping"]
    rows = []
    for model, minibatch in [("gpt2-xl", 16), ("bert-large", 64)]:
        for i, system in enumerate(systems):
            fits = not (model == "bert-large" and system == "gpipe-swap")  # a missing bar
            rows.append(
                {
                    "model": model,
                    "minibatch": minibatch,
                    "system": system,
                    "policy": system.split(" ")[0],
                    "role": "harmony" if system.startswith("harmony") else "baseline",
                    "fits": fits,
                    "plan": f"{system} x4 uF=2",
                    "microbatch": 2,
                    "reason": "" if fits else "out of memory",
                    "swap_gb": 10.0 * (i + 1),
                    "samples_per_s": 1.0 + i / 3,
                }
            )
    return pd.DataFrame(rows)


def _figure_charts():
    from harmony.workbench import experiments as E
    from harmony.workbench.experiments import disk_tier

    grid = _grid()
    yield "swap volume", E.swap_volume_chart(grid, title="swap")
    yield "throughput", E.throughput_chart(grid, title="throughput")
    yield "systems", E.systems_chart(grid, title="systems")
    ladder = pd.DataFrame(
        {
            "model": ["bert-96"] * 3,
            "rung": [0, 1, 2],
            "technique": ["per-layer swapping", "+ packs", "+ prefetch"],
            "how": ["a", "b", "c"],
            "policy": ["layer-swap", "layer-swap", "harmony-pp"],
            "plan": ["p0", "p1", "p2"],
            "microbatch": [1, 2, 2],
            "iteration_s": [30.0, 20.0, 10.0],
            "speedup_vs_previous": [1.0, 1.5, 2.0],
            "speedup_vs_bottom": [1.0, 1.5, 3.0],
            "host_gpu_gb": [200.0, 150.0, 20.0],
            "gpu_gpu_gb": [0.0, 0.0, 1.0],
            "pcie_gb": [200.0, 150.0, 21.0],
        }
    )
    yield "ladder", E.ladder_chart(ladder, title="ladder")
    karma = pd.DataFrame(
        {
            "model": ["gpt2-xl", "gpt2-xl", "bert-large"],
            "minibatch": [16, 16, 64],
            "baseline": ["layer-swap", "gpipe-swap", "layer-swap"],
            "karma_speedup": [1.5, 1.2, 1.1],
            "plan": ["a", "b", "c"],
            "karma_plan": ["d", "e", "f"],
            "microbatch": [2, 2, 4],
        }
    )
    yield "karma", E.karma_chart(karma, title="karma")
    hydra = pd.DataFrame(
        {
            "baseline": ["model-parallel", "gpipe-swap"],
            "baseline_total_s": [700.0, 150.0],
            "hydra_total_s": [100.0, 100.0],
            "jobs": ["gpt2-xl-24L, gpt2-xl-48L"] * 2,
            "microbatch": [2, 2],
        }
    )
    yield "hydra", E.hydra_chart(hydra, title="hydra")
    heat = pd.DataFrame(
        {
            "microbatch": [1, 2, 1, 2],
            "pack_size": [1, 1, 2, 2],
            "packs": [24, 24, 12, 12],
            "iteration_s": [3.0, 2.0, 2.5, float("nan")],
            "peak_memory_gb": [5.0, 6.0, 7.0, 12.0],
            "swap_gb": [30.0, 30.0, 20.0, float("nan")],
            "status": ["fits", "fits", "fits", "out of memory"],
        }
    )
    yield "heatmap", E.heatmap_chart(heat, title="heatmap")
    search = pd.DataFrame(
        {"model": ["gpt2-xl", "bert-large"], "search_s": [1.5, 0.5], "uF": [2, 4], "uB": [2, 4]}
    ).assign(bwd_packs=[8, 6], plan=["a", "b"])
    yield "search time", E.search_time_chart(search, title="search")
    scaling = pd.DataFrame(
        {
            "model": ["gpt2-10b"] * 3,
            "n_gpus": [1, 2, 4],
            "policy": ["harmony-pp"] * 3,
            "plan": ["a", "b", "c"],
            "samples_per_s": [1.0, 1.9, 3.5],
            "efficiency": [1.0, 0.95, 0.87],
        }
    )
    yield "scaling", E.scaling_chart(scaling, title="scaling")
    fidelity = pd.DataFrame(
        {
            "status": ["ran", "ran"],
            "simulated_s": [1.0, 2.0],
            "measured_s": [1.1, 1.9],
            "simulated_peak_mb": [5.0, 6.0],
            "measured_peak_mb": [5.2, 6.1],
            "layers_per_pack": [1, 2],
            "microbatch": [2, 4],
        }
    )
    yield "fidelity", E.fidelity_chart(fidelity, title="fidelity")
    torch_runs = pd.DataFrame(
        {
            "system": ["harmony", "torch offload"],
            "status": ["ran", "ran"],
            "samples_per_s": [2, 1.0],
        }
    )
    yield "vs torch", E.torch_offload_chart(torch_runs, title=["vs torch", "second line"])
    sweep = pd.DataFrame(
        {
            "disk": ["roomy", "nvme", "sata"],
            "fits": [True, True, True],
            "read_GBps": [0.0, 3.0, 0.5],
            "iteration_s": [10.0, 12.0, 30.0],
            "reads_and_writes": ["at once (full duplex)"] * 3,
            "slowdown": [1.0, 1.2, 3.0],
            "disk_read_gb": [0.0, 40.0, 40.0],
            "lower_bound_by": ["compute", "disk", "disk"],
        }
    )
    yield "disk slowdown", disk_tier.slowdown_chart(sweep, title="disk")


def _lesson_charts():
    from harmony.workbench import lessons as L
    from harmony.workbench.lessons import swapping

    two = {"harmony-pp": _trace(minibatch=4, u=4), "harmony-pp, 2 packs": _trace(minibatch=8, u=4)}
    yield "lesson timelines", L.timelines(two)
    kinds = pd.DataFrame(
        {
            "plan": ["harmony-pp", "harmony-pp", "layer-swap", "layer-swap"],
            "kind": ["STASH_OUT", "STASH_IN", "STASH_OUT", "STASH_IN"],
            "GB": [1.0, 1.0, 3.0, 3.0],
            "simulated_GB": [1.0, 1.0, 3.0, 3.0],
        }
    )
    yield "lesson bytes", swapping.bytes_chart(kinds, title="bytes")
    links = pd.DataFrame(
        {
            "link": ["paper", "1GB/s"] * 2,
            "link_GBps": [12.0, 1.0] * 2,
            "plan": ["harmony-pp"] * 2 + ["layer-swap"] * 2,
            "iteration_s": [1.0, 3.0, 2.0, 9.0],
            "limited_by": ["compute", "link"] * 2,
        }
    )
    yield "lesson links", swapping.link_chart(links, title="links")
    grouping = pd.DataFrame(
        {
            "microbatches": [2, 4, 2, 4],
            "policy": ["harmony-pp"] * 2 + ["harmony-no-grouping"] * 2,
            "microbatch": [8, 4, 8, 4],
            "w_in_gb": [1.0, 1.0, 2.0, 4.0],
            "swap_gb": [3.0, 3.0, 4.0, 8.0],
            "iteration_s": [1.0, 1.1, 1.5, 2.5],
            "fits": [True] * 4,
        }
    )
    yield "lesson grouping", L.grouping_chart(grouping, title="grouping")
    scheduling = pd.DataFrame(
        {
            "link": ["paper", "paper", "1GB/s", "1GB/s"],
            "prefetch_packs": [1, 2, 1, 2],
            "iteration_s": [1.0, 0.9, 3.0, 2.0],
            "gpu_idle_s": [0.1, 0.05, 1.5, 0.7],
            "peak_gb": [5.0, 6.0, 5.0, 6.0],
            "limited_by": ["compute"] * 4,
        }
    )
    yield "lesson scheduling", L.scheduling_chart(scheduling, title="scheduling")
    many = pd.DataFrame(
        {
            "wiring": ["shared uplink"] * 2 + ["own uplinks"] * 2,
            "policy": ["harmony-pp"] * 4,
            "n_gpus": [1, 2, 1, 2],
            "samples_per_s": [1.0, 1.8, 1.0, 1.9],
            "efficiency": [1.0, 0.9, 1.0, 0.95],
            "limited_by": ["compute"] * 4,
        }
    )
    yield "lesson many GPUs", L.scaling_lesson_chart(many, title="many")
    losses = pd.DataFrame({"step": [0, 1], "engine": [2.0, 1.5], "reference": [2.0, 1.5]})
    yield "lesson losses", L.loss_lines(losses, title="losses")


def _library_charts():
    trace = _trace(minibatch=8, u=4)
    yield "timeline", timeline_chart(trace, title="t")
    yield "timeline by model", timeline_chart(trace, title="t", color="model", names=["BERT"])
    yield "memory", memory_chart(trace)
    losses = pd.DataFrame({"step": [0, 1], "engine": [2.0, 1.5], "reference": [2.0, 1.5]})
    yield "loss", loss_chart(losses, title="loss")
    df = pd.DataFrame(
        {"how": ["simulated", "measured"], "policy": ["harmony-pp"] * 2, "swap_mb": [1.0, 2.0]}
    )
    yield "bars", bar_chart(df, "how", "swap_mb", "policy", title="bars")
    yield "bars, one series", bar_chart(df, "how", "swap_mb", title="bars")
    policies = pd.DataFrame(
        {"policy": ["harmony-pp", "layer-swap"], "iteration_s": [1.0, None]}
    ).assign(status=["fits", "does not fit: too big"])
    yield "policy bars", charts.policy_bars(policies, "iteration_s", "time", "s", "harmony-pp")


def _explorer_charts():
    from harmony.workbench.widgets import PackExplorer

    yield "explorer, 4 GPUs", PackExplorer(model="bert-large", minibatch=32).chart()
    yield "explorer, a problem", PackExplorer(model="gpt2-tiny", source="reference").chart()


EVERY_CHART = [_library_charts, _figure_charts, _lesson_charts, _explorer_charts]


@pytest.mark.parametrize("make", EVERY_CHART, ids=lambda f: f.__name__.strip("_"))
def test_every_chart_says_what_it_shows(make):
    """Titles on the chart, every axis and every legend, in words (no snake_case
    column names), and no Python repr in any text, on the Vega spec the browser draws."""
    from chart_rules import problems

    found = {name: problems(chart.to_dict()) for name, chart in make()}
    assert len(found) >= 2
    assert not {name: p for name, p in found.items() if p}


def test_the_rules_catch_what_a_reader_would_miss():
    """The rules are not vacuous: a chart with raw names and a repr in its title fails."""
    import altair as alt
    from chart_rules import problems

    bad = (
        alt.Chart(pd.DataFrame({"n_gpus": ["a"], "samples_per_s": [1.0], "p": ["x"]}))
        .mark_bar()
        .encode(x="n_gpus:N", y=alt.Y("samples_per_s:Q"), color=alt.Color("p:N", title=None))
        .properties(title=str(["gpt2-xl-24L", "gpt2-xl-48L"]))
    )
    said = " ".join(problems(bad.to_dict()))
    assert "raw column name 'n_gpus'" in said and "raw column name 'samples_per_s'" in said
    assert "legend without a title" in said and "looks like Python repr" in said


def test_tooltip_numbers_are_written_as_d3_writes_them():
    from harmony.workbench.labels import formatted_column

    nan, inf = float("nan"), float("inf")
    assert formatted_column([12345678, 999_999, 0.0, 1e-3, nan], ".3~s") == [
        "12.3M",
        "1M",
        "0",
        "1m",
        "–",
    ]
    assert formatted_column([3.5726, 3.0, 0.12, -inf], ".4~f") == ["3.5726", "3", "0.12", "–"]
    assert formatted_column([25.4261, 0.000123456], ".3~g") == ["25.4", "0.000123"]
    assert formatted_column([-1, 7.0, nan], "d") == ["-1", "7", "–"]
    assert formatted_column(["a", None, 2], None) == ["a", "", "2"]
    with pytest.raises(ValueError, match="not one of"):
        formatted_column([1.0], ",.2%")
