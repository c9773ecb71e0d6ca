"""Charts are built from traces without a browser, stay under Altair's row limit, take
their colours from one palette, and display without internet."""

import re

import pandas as pd
import pytest

pytest.importorskip("altair")

import harmony  # noqa: E402
from harmony.graph import COMPUTE_KINDS, TRANSFER_KINDS  # noqa: E402
from harmony.plan import Plan, uniform_packs  # noqa: E402
from harmony.policies import names  # noqa: E402
from harmony.workbench import charts, display, palette  # noqa: E402
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
    assert memory_chart(trace).to_dict()["layer"]


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
    scale = bar_chart(df, "case", "v", "policy").to_dict()["encoding"]["color"]["scale"]
    assert scale["domain"] == names()[:2] and scale["range"] == [colors[p] for p in names()[:2]]
    assert palette.color("harmony.Engine") == colors[names("harmony")[0]]
    assert palette.color("some other series") == palette.color("some other series")


def test_timeline_legend_says_what_each_kind_is():
    spec = timeline_chart(_trace(minibatch=4, u=4), subtitle="packs").to_dict()
    legend = spec["encoding"]["color"]["legend"]
    assert "weights host → GPU" in legend["labelExpr"]
    assert spec["encoding"]["color"]["scale"]["range"][0] == palette.KIND_COLORS["FWD"]
    assert (
        spec["title"]["subtitle"][0] == "packs"
        and "h2d: host → GPU" in spec["title"]["subtitle"][1]
    )
    assert spec["params"][0]["bind"] == "scales"  # zoom and pan in time


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
