"""A chart's data sent to the page as columns comes back as the same rows: the
page's unpacking (JavaScript, run in Node where it is installed) gives back the
spec as it was, and what cannot be packed faithfully is sent as rows."""

import json
import re
import shutil
import subprocess

import pytest

pytest.importorskip("altair")
pytest.importorskip("ipywidgets")

from harmony.workbench import display  # noqa: E402
from harmony.workbench.live_spec import exploration_spec  # noqa: E402
from harmony.workbench.live_update import values_as_params  # noqa: E402
from harmony.workbench.packed_data import PACK_FROM_ROWS, PACKED, UNPACK_JS, packed  # noqa: E402
from harmony.workbench.widgets import PackExplorer  # noqa: E402


def _rows(n, **extra):
    return [
        {"lane": f"gpu{i % 4}", "start_s": i / 3, "fits": i % 2 == 0, "note": None, **extra}
        for i in range(n)
    ]


def _columns_back(table: dict) -> list[dict]:
    """A packed dataset as rows, read the way UNPACK_JS reads it."""
    columns = {
        f: (c if isinstance(c, list) else [c["values"][i] for i in c["codes"]])
        for f, c in table[PACKED].items()
    }
    return [{f: columns[f][i] for f in columns} for i in range(table["rows"])]


def test_large_datasets_go_as_columns_with_repeated_texts_coded():
    rows = _rows(PACK_FROM_ROWS)
    table = packed({"datasets": {"d": rows}})["datasets"]["d"]
    assert table["rows"] == len(rows)
    lanes = table[PACKED]["lane"]
    assert lanes["values"] == ["gpu0", "gpu1", "gpu2", "gpu3"]  # each text once
    assert lanes["codes"][:5] == [0, 1, 2, 3, 0]
    assert isinstance(table[PACKED]["start_s"], list)  # numbers as they are
    assert _columns_back(table) == rows  # same rows, fields in the same order
    assert list(_columns_back(table)[0]) == list(rows[0])


def test_what_cannot_be_packed_faithfully_goes_as_rows():
    small = _rows(PACK_FROM_ROWS - 1)
    ragged = _rows(PACK_FROM_ROWS)
    ragged[5] = {**ragged[5], "extra": 1}  # a field of its own: a column would invent it
    missing = _rows(PACK_FROM_ROWS)
    del missing[7]["note"]
    spec = {"datasets": {"small": small, "ragged": ragged, "missing": missing}, "mark": "bar"}
    assert packed(spec) == spec
    assert packed({"mark": "bar"}) == {"mark": "bar"}  # no datasets: nothing to do
    # texts mostly different stay a plain list (codes would add to them)
    names = [f"task {i}" for i in range(PACK_FROM_ROWS)]
    rows = [{**r, "what": w} for r, w in zip(_rows(PACK_FROM_ROWS), names)]
    assert packed({"datasets": {"d": rows}})["datasets"]["d"][PACKED]["what"] == names


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the page's code")
def test_the_page_unpacks_the_explorers_spec_to_the_same_rows():
    spec = exploration_spec(PackExplorer().compute())
    sent = packed(spec)
    assert len(json.dumps(sent)) < len(json.dumps(spec)) / 2
    js = (
        "const spec = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        f"process.stdout.write(JSON.stringify(({UNPACK_JS})(spec)));"
    )
    out = subprocess.run(
        ["node", "-e", js], input=json.dumps(sent), capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == json.loads(json.dumps(spec))


def test_the_chart_html_carries_packed_data_and_unpacks_it_before_drawing():
    spec = exploration_spec(PackExplorer().compute())
    html = display.live_bundle(spec)["text/html"]
    data = re.search(r'<script type="application/json" id="[^"]+">(.*?)</script>', html, re.S)[1]
    sent = packed(values_as_params(spec))  # a live chart's titles go as parameters
    assert json.loads(data.replace("<\\/", "</")) == json.loads(json.dumps(sent))
    draw = html[html.index("function draw()") :]
    assert draw.index(UNPACK_JS) < draw.index("window.vegaEmbed(live, spec")
