"""A live chart's titles and numeric scale bounds go as parameters, and charts that
differ in those and their data only share a key, so that the page updates the view
on screen (the browser test checks the page's side: the view kept, and what it shows)."""

import re

import pytest

pytest.importorskip("altair")
pytest.importorskip("ipywidgets")

from harmony.workbench import display  # noqa: E402
from harmony.workbench.live_spec import exploration_spec  # noqa: E402
from harmony.workbench.live_update import PARAM, shape_key, values_as_params  # noqa: E402
from harmony.workbench.widgets import PackExplorer  # noqa: E402


def _texts(spec) -> list[str]:
    import vl_convert as vlc

    svg = vlc.vegalite_to_svg(spec, vl_version=display._vl_version())
    return re.findall(r">([^<>]+)</t", svg)  # a text's, or each line's (a tspan)


def test_view_titles_become_parameters_and_axis_titles_stay():
    spec = {
        "title": {"text": ["line one", "line two"], "subtitle": "under it", "anchor": "start"},
        "vconcat": [
            {
                "title": "the left",
                "mark": "bar",
                "data": {"values": [{"x": 1}]},
                "encoding": {
                    "x": {
                        "field": "x",
                        "type": "quantitative",
                        "title": "x (s)",
                        "scale": {"domain": [0, 350], "nice": False},
                    },
                    "color": {"field": "k", "scale": {"domain": ["a", "b"]}},
                },
            }
        ],
        "params": [{"name": "zoom", "value": 1}],
    }
    out = values_as_params(spec)
    values = {p["name"]: p.get("value") for p in out["params"]}
    assert values["zoom"] == 1  # its own parameters kept
    assert out["title"]["anchor"] == "start"
    top, sub = out["title"]["text"]["expr"], out["title"]["subtitle"]["expr"]
    assert values[top] == ["line one", "line two"] and values[sub] == "under it"
    assert values[out["vconcat"][0]["title"]["text"]["expr"]] == "the left"
    x = out["vconcat"][0]["encoding"]["x"]
    assert x["title"] == "x (s)"  # an axis's: as it was
    low, high = x["scale"]["domain"]
    assert (values[low["expr"]], values[high["expr"]]) == (0, 350) and not x["scale"]["nice"]
    color = out["vconcat"][0]["encoding"]["color"]
    assert color["scale"]["domain"] == ["a", "b"]  # names: the chart's shape, as they were
    assert all(n.startswith(PARAM) for n in values if n != "zoom")
    drawn = _texts(out)  # vega draws the titles and the axis from the parameters
    assert {"line one", "line two", "under it", "the left", "x (s)", "350"} <= set(drawn)


def test_only_data_and_titles_changed_share_a_key():
    ex = PackExplorer(bwd_microbatch=4)  # GPT-2 XL fits too (no problem to show)
    key = shape_key(values_as_params(exploration_spec(ex.compute())))
    ex.pack_size.value = 3  # other packs: other data, other titles
    assert shape_key(values_as_params(exploration_spec(ex.compute()))) == key
    ex.model.value = "gpt2-xl"  # and the bars' axes reach further
    assert shape_key(values_as_params(exploration_spec(ex.compute()))) == key
    ex.policy.value = "harmony-dp"  # other task kinds and bars in another order
    assert shape_key(values_as_params(exploration_spec(ex.compute()))) != key


def test_live_outputs_carry_their_key_and_notebook_charts_are_left_as_they_are():
    spec = exploration_spec(PackExplorer().compute())
    live = display.live_bundle(spec)["text/html"]
    assert f'key = "{shape_key(values_as_params(spec))}"' in live
    assert PARAM in live
    shown = display.mimebundle(spec, picture=False)["text/html"]
    data = re.search(r'<script type="application/json"[^>]*>(.*?)</script>', shown, re.S)[1]
    assert PARAM not in data and 'key = ""' in shown
