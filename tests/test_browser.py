"""The notebooks in a real browser, offline: JupyterLab on 127.0.0.1, headless
Chromium (Playwright) with every request that does not go to 127.0.0.1
aborted. Every notebook (the figures' and the lessons') runs all its cells
with the smoke parameters of tests/test_notebooks.py; every chart must be
drawn by vega-embed with nothing fetched from a CDN; moving a slider in the
explorer must redraw its chart; a saved untrusted notebook must still show
its charts as pictures. Screenshots go to ``test-artifacts/browser/`` (or
``$HARMONY_BROWSER_ARTIFACTS``).

Needs Chromium and Playwright; skipped with a message saying how to install
them when they are missing, a failure when ``CI`` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest
from chart_rules import DRAWN_TEXT, RENDERED, SVG_OF
from executed import shared_directory
from test_notebooks import NOTEBOOK_DIR, parameter_names, parameters_cell, smoke_parameters

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(
    os.environ.get("HARMONY_BROWSER_ARTIFACTS") or ROOT / "test-artifacts" / "browser"
)
INSTALL = (
    "install Chromium and Playwright: `sudo apt-get install -y chromium` and "
    "`.venv/bin/pip install playwright` (or set HARMONY_CHROMIUM to a Chromium binary)"
)
#: Chromium flags for a container (root, no GPU, no sandbox) that must not reach the network
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
#: JupyterLab settings: the notebook's kernel starts without asking, every cell is in the page
#: (charts of off-screen cells are drawn too), no news fetched
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}
RUN_TIMEOUT_S = 300
#: every notebook, figures' and lessons', as a path under notebooks/
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted(NOTEBOOK_DIR.glob("lessons/*.ipynb"))
#: tested on their own below (a slider, a legend)
OWN_TESTS = {"00_quickstart.ipynb", "01_explorer.ipynb"}
#: a cell that ends with one of these names shows a chart: each notebook's lower bound
CHART_NAME = re.compile(r"^\w*(chart|fig|timeline|swap|loss)\w*$")
#: the classes of a drawn chart's data-mark groups (not axes, legends or titles) that have
#: items but show none of them: bars of zero height, lines without a colour
EMPTY_MARKS = (
    "async root => {"
    + SVG_OF
    + """
  const [svg, done] = await svgOf(root);
  if (!svg) return ["no drawn chart"];
  const paint = (el, attr) => {
    const v = el.getAttribute(attr);
    return v && v !== "none" && v !== "transparent";
  };
  const visible = el => {
    if (el.tagName === "text") return el.textContent.trim().length > 0;
    const box = el.getBBox();
    const line = /mark-(line|rule)/.test(el.parentNode.getAttribute("class"));
    return line ? paint(el, "stroke") && (box.width > 0.5 || box.height > 0.5)
                : (paint(el, "fill") || paint(el, "stroke"))
                  && box.width > 0.5 && box.height > 0.5;
  };
  const groups = [...svg.querySelectorAll("g.role-mark")].filter(g => g.children.length);
  const empty = groups.filter(g => ![...g.children].some(visible))
    .map(g => g.getAttribute("class"));
  done();
  return empty;
}"""
)
#: a chart is drawn once vega-embed has run its view (SVG or canvas) and handed it over
DRAWN = ".vega-embed.harmony-drawn"


def _missing(why: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}: CI is set, so the browser test has to run; {INSTALL}")
    pytest.skip(f"{why}; to run it, {INSTALL}")


def _chromium() -> str | None:
    found = os.environ.get("HARMONY_CHROMIUM")
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = found or shutil.which(name)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy(src: Path, dst: Path, params: dict) -> None:
    """``src`` with ``params`` injected after its parameters cell, as papermill does."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(src))
    if parameters_cell(nb) is not None:
        names = parameter_names(src)
        nb = parameterize_notebook(nb, {k: v for k, v in params.items() if k in names})
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)


def _untrusted(path: Path) -> None:
    """A saved notebook with one chart output, as a run would leave it, never signed."""
    import altair as alt
    import pandas as pd

    from harmony.workbench import charts

    chart = (
        alt.Chart(pd.DataFrame({"x": ["a", "b"], "y": [1, 3]}), title="saved chart")
        .mark_bar()
        .encode(x="x:N", y="y:Q")
    )
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("chart", execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output("display_data", data=charts.mimebundle(chart.to_dict()))
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# saved"), cell]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving copies of the notebooks, and a Chromium context that can
    reach nothing else."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed")
    browser_path = _chromium()
    if browser_path is None:
        _missing("no Chromium found")
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        _missing("JupyterLab is not installed in this environment (pip install -e '.[notebooks]')")

    home = tmp_path_factory.mktemp("lab")
    root = home / "root"
    out = home / "out"
    for path in NOTEBOOKS:
        name = path.relative_to(NOTEBOOK_DIR)
        params = {**smoke_parameters(path), "out_dir": str(out / name.with_suffix(""))}
        _copy(path, root / name, params)
    _untrusted(root / "saved.ipynb")
    for name, values in LAB_SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "HARMONY_CHARTS"}  # the default renderer
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTER_DATA_DIR=str(home / "data"),  # where the notebooks' trust is signed
    )
    log = (home / "lab.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            "--ServerApp.allow_root=True",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={home / 'settings'}",
            f"--LabApp.workspaces_dir={home / 'workspaces'}",
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-3000:]}"
                    )
                time.sleep(0.5)
        blocked: list[str] = []

        def only_local(route):
            if urlparse(route.request.url).hostname == "127.0.0.1":
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / ".gitignore").write_text("*\n")  # screenshots are never committed
        # screenshots of earlier sessions go; those of this session's other workers stay
        started = shared_directory(tmp_path_factory).parent.stat().st_ctime
        for old in ARTIFACTS.glob("*.png"):
            with contextlib.suppress(FileNotFoundError):
                if old.stat().st_mtime < started:
                    old.unlink()
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=browser_path, args=FLAGS
            )  # a fresh profile
            context = browser.new_context(viewport={"width": 1500, "height": 1800})
            context.route("**/*", only_local)
            yield Lab(context, base, token, blocked, home, root)
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


class Lab:
    """The running JupyterLab and the browser context that talks to it."""

    def __init__(self, context, base: str, token: str, blocked: list[str], home: Path, root: Path):
        self.context, self.base, self.token, self.blocked = context, base, token, blocked
        self.home, self.root = home, root

    def add_trusted(self, executed: Path, name: str) -> str:
        """A copy of the ``executed`` notebook served as ``name``, signed as trusted (as
        its author's JupyterLab would have it after running it there: its charts' scripts
        run when it opens)."""
        from nbformat.sign import NotebookNotary

        nb = nbformat.read(executed, as_version=4)
        NotebookNotary(data_dir=str(self.home / "data")).sign(nb)
        dst = self.root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, dst)
        return name

    def open(self, path: str):
        """A tab with ``path`` open, its kernel idle."""
        page = self.context.new_page()
        # a workspace of its own, reset: the tab opens alone (no tab of an earlier page
        # restored beside it that could take "Run All Cells")
        workspace = re.sub(r"\W", "-", path)
        page.goto(f"{self.base}/lab/workspaces/{workspace}/tree/{path}?reset&token={self.token}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
        # the status bar says "Python 3 (ipykernel) | Idle" once the kernel is connected
        page.locator(
            ".jp-StatusBar-Widget", has_text=re.compile(r"ipykernel.*\| Idle")
        ).first.wait_for(timeout=90_000)
        return page

    def run_all(self, page, name: str) -> None:
        """Run every cell from the Run menu; fail with the traceback of a cell that raised."""
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            texts = [t.strip() for t in prompts.all_inner_texts()]
            if texts and all(re.fullmatch(r"\[\d+\]:", t) for t in texts):
                break
            errors = [
                e
                for e in page.locator(
                    '[data-mime-type="application/vnd.jupyter.stderr"]'
                ).all_inner_texts()
                if "Traceback" in e or "Error" in e.splitlines()[0]
            ]
            if errors:
                self.screenshot(page, f"{name}-error")
                pytest.fail(f"{name}: a cell raised:\n{errors[0][-3000:]}")
            if time.monotonic() > deadline:
                self.screenshot(page, f"{name}-timeout")
                pytest.fail(f"{name}: cells not done after {RUN_TIMEOUT_S} s: {texts}")
            time.sleep(1)

    def charts_drawn(self, page, name: str, at_least: int) -> list:
        """Wait until every chart output of ``page`` is drawn by vega-embed; screenshot each."""
        charts = page.locator(".harmony-chart")
        deadline = time.monotonic() + 60
        while True:
            n = charts.count()
            drawn = page.locator(f".harmony-chart {DRAWN}").count()
            if n >= at_least and drawn == n:
                break
            if time.monotonic() > deadline:
                self.screenshot(page, f"{name}-charts")
                pytest.fail(
                    f"{name}: {drawn} of {n} charts drawn (expected at least {at_least}); "
                    f"page says: {_problems(page) or 'nothing'}"
                )
            time.sleep(0.5)
        assert not _problems(page)
        empty, unclear = [], []
        for i, chart in enumerate(charts.all()):
            chart.scroll_into_view_if_needed()
            chart.screenshot(path=ARTIFACTS / f"{name}-chart{i}.png")
            said = f"chart {i} ({chart.evaluate(DRAWN_TEXT)['title'] or 'untitled'})"
            empty += [f"{said}: {m}" for m in chart.evaluate(EMPTY_MARKS)]
            # what a reader would miss: titles, overlapping tick labels, Python repr
            unclear += [f"{said}: {m}" for m in chart.evaluate(RENDERED)]
        assert not empty, f"{name}: marks drawn but nothing visible: {empty}"
        assert not unclear, f"{name}: charts a reader cannot read: {unclear}"
        return charts.all()

    def screenshot(self, page, name: str) -> None:
        page.screenshot(path=ARTIFACTS / f"{name}.png")


def _problems(page) -> list[str]:
    text = page.locator("#main").inner_text()
    return [
        line
        for line in text.splitlines()
        if "Error loading script" in line or "the interactive chart failed" in line
    ]


def _drawn_text(chart) -> str:
    """Every text the chart in ``chart`` (a locator) shows, drawn as SVG or on a canvas."""
    return chart.evaluate(DRAWN_TEXT)["text"]


def _no_requests_blocked(lab: Lab) -> None:
    assert not lab.blocked, f"the page tried to reach beyond 127.0.0.1: {lab.blocked[:5]}"


def test_quickstart_draws_every_chart_offline(lab):
    page = lab.open("00_quickstart.ipynb")
    lab.run_all(page, "00_quickstart")
    lab.charts_drawn(page, "00_quickstart", at_least=3)  # loss, swap timeline, bytes per step
    legend = _drawn_text(page.locator(".harmony-chart").first)
    assert "plain PyTorch loop" in legend and "harmony.Engine" in legend
    lab.screenshot(page, "00_quickstart")
    _no_requests_blocked(lab)


#: watches the explorer's output (``root``) through a change: how many times a new output
#: was on screen with its chart not drawn yet (the update seen half-built)
HALF_BUILT = """root => {
  const log = window.__halfBuilt = {seen: 0};
  const children = () => [...root.querySelectorAll(".jp-OutputArea-child")];
  children().forEach(c => { c.__old = true; });
  const half = c => !c.__old && !c.querySelector('.harmony-whole[style*="none"]')
    && c.querySelector(".harmony-chart") && !c.querySelector(".harmony-drawn");
  const watch = new MutationObserver(() => { if (children().some(half)) log.seen += 1; });
  watch.observe(root, {subtree: true, childList: true, attributes: true});
  (window.__watches || []).forEach(w => w.disconnect());
  window.__watches = [watch];
}"""


def _window_listeners(page) -> int:
    """How many event listeners the page's window has (a vega view not finalized keeps its own)."""
    cdp = page.context.new_cdp_session(page)
    window = cdp.send("Runtime.evaluate", {"expression": "window"})["result"]["objectId"]
    listeners = cdp.send("DOMDebugger.getEventListeners", {"objectId": window})["listeners"]
    cdp.detach()
    return len(listeners)


def test_explorer_redraws_when_a_slider_moves(lab):
    page = lab.open("01_explorer.ipynb")
    lab.run_all(page, "01_explorer")
    lab.charts_drawn(page, "01_explorer", at_least=1)
    explorer = page.locator(".widget-output .harmony-chart").first
    before = _drawn_text(explorer)
    assert "s/iter" in before and "faster" in before, before[:300]
    widget = page.locator(".widget-vbox").first
    widget.screenshot(path=ARTIFACTS / "01_explorer-widget-before.png")
    output = widget.locator(".widget-output").first
    listeners = _window_listeners(page)

    slider = widget.locator(
        ".widget-slider", has=page.locator(".widget-label", has_text="layers per pack")
    )
    slider.locator(".noUi-handle").focus()
    output.evaluate(HALF_BUILT)
    page.keyboard.press("ArrowRight")
    assert slider.locator(".widget-readout").inner_text().strip() == "3"
    after = _redrawn(page, before)
    assert after != before and "s/iter" in after
    widget.screenshot(path=ARTIFACTS / "01_explorer-widget-after.png")
    # back and forth: the outputs kept for settings seen before, drawn again
    for key, packs in (("ArrowLeft", "2"), ("ArrowRight", "3")):
        shown = _drawn_text(page.locator(".widget-output .harmony-chart").first)
        _mark_view(output)
        slider.locator(".noUi-handle").focus()
        page.keyboard.press(key)
        assert slider.locator(".widget-readout").inner_text().strip() == packs
        in_place = _redrawn(page, shown)
        # the chart differed in its data and titles only: the view on screen took them
        assert _view_marked(output), "a chart of the same shape was drawn anew"
    # a policy changes the chart's shape (its kinds, the bars' order): a new view; back, the
    # chart drawn anew shows what the view updated in place showed
    policy = widget.locator(
        ".widget-inline-hbox", has=page.locator(".widget-label", has_text="policy")
    )
    for choice in ("harmony-dp", "harmony-pp"):
        shown = _drawn_text(page.locator(".widget-output .harmony-chart").first)
        _mark_view(output)
        policy.first.locator("select").select_option(label=choice)
        anew = _redrawn(page, shown)
        assert not _view_marked(output)
    assert anew == in_place
    # a view that will not take the new data: the chart is drawn anew, not left broken
    output.locator(DRAWN).first.evaluate(
        "e => { e.harmonyView.data = () => { throw new Error('no such dataset'); }; }"
    )
    _mark_view(output)
    slider.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowLeft")
    assert _redrawn(page, anew) == before and not _view_marked(output)
    # one step: the old output stayed until the new chart was drawn, then went whole
    assert page.evaluate("() => window.__halfBuilt.seen") == 0, "an update was seen half-built"
    assert output.locator(".harmony-whole").count() == 1  # no old output left behind
    # the charts replaced were let go: their views no longer listen on the window
    assert _window_listeners(page) == listeners
    assert not _problems(page)
    _no_requests_blocked(lab)


def _mark_view(output) -> None:
    output.locator(DRAWN).first.evaluate("e => { e.harmonyTestMark = true; }")


def _view_marked(output) -> bool:
    """Whether the chart drawn in ``output`` is the one :func:`_mark_view` marked."""
    return output.locator(DRAWN).first.evaluate("e => e.harmonyTestMark === true")


def _redrawn(page, before: str) -> str:
    """Wait (up to 60 s) until the explorer's chart is drawn and shows other texts
    than ``before``; its texts."""
    deadline = time.monotonic() + 60
    while True:  # the output is replaced: the new chart must be drawn and show other texts
        charts = page.locator(".widget-output .harmony-chart")
        drawn = page.locator(f".widget-output .harmony-chart {DRAWN}").count()
        if charts.count() == 1 and drawn and _drawn_text(charts.first) != before:
            return _drawn_text(charts.first)
        assert time.monotonic() < deadline, (
            "the explorer's chart did not change after the slider moved"
        )
        time.sleep(0.5)


def test_explorer_moves_state_to_disk_when_host_memory_and_disk_are_picked(lab):
    page = lab.open("01_explorer.ipynb")
    lab.run_all(page, "01_explorer-disk")
    lab.charts_drawn(page, "01_explorer-disk", at_least=1)
    widget = page.locator(".widget-vbox").first

    def pick(label: str, starts: str) -> None:
        select = widget.locator(
            ".widget-dropdown", has=page.locator(".widget-label", has_text=label)
        ).locator("select")
        options = [o.strip() for o in select.locator("option").all_inner_texts()]
        select.select_option(label=next(o for o in options if o.startswith(starts)))

    pick("host memory", "75%")
    pick("disk", "NVMe")
    deadline = time.monotonic() + 90
    while True:  # redrawn on the server with a disk: its lanes and what lives there
        charts = page.locator(".widget-output .harmony-chart")
        drawn = page.locator(f".widget-output .harmony-chart {DRAWN}").count()
        text = _drawn_text(charts.first) if drawn else ""
        if drawn and "on disk the optimizer state" in text and "host.disk_read" in text:
            break
        assert time.monotonic() < deadline, f"no disk tier in the explorer's chart: {text[:400]}"
        time.sleep(0.5)
    assert not _problems(page)
    widget.screenshot(path=ARTIFACTS / "01_explorer-widget-disk.png")
    _no_requests_blocked(lab)


def expected_charts(path: Path) -> int:
    """How many chart outputs ``path`` shows at least: its cells that end with a chart."""
    nb = nbformat.read(path, as_version=4)
    return sum(
        1
        for c in nb.cells
        if c.cell_type == "code"
        and c.source.strip()
        and CHART_NAME.match(c.source.strip().splitlines()[-1].strip())
    )


def test_every_notebook_counts_its_charts():
    """The lower bound below is not vacuous: every figure notebook shows a chart."""
    for path in NOTEBOOKS:
        if path.name not in OWN_TESTS:
            assert expected_charts(path) >= 1, f"{path.name}: no cell ends with a chart"


@pytest.mark.parametrize(
    "path",
    [p for p in NOTEBOOKS if p.name not in OWN_TESTS],
    ids=lambda p: str(p.relative_to(NOTEBOOK_DIR).with_suffix("")),
)
def test_every_chart_of_a_notebook_draws_offline(lab, path, executed_notebook):
    """The notebook as its papermill run left it (:mod:`executed`: the run the notebook
    tests check), opened trusted: every chart is drawn by its inlined vega-embed, and
    nothing is fetched. (Cells run live in the browser in the quickstart's and the
    explorer's tests.)"""
    name = path.relative_to(NOTEBOOK_DIR)
    shot = str(name.with_suffix("")).replace("/", "-")
    page = lab.open(lab.add_trusted(executed_notebook(path).notebook, f"executed/{name}"))
    lab.charts_drawn(page, shot, at_least=expected_charts(path))
    lab.screenshot(page, shot)
    page.close()
    _no_requests_blocked(lab)


def test_a_saved_untrusted_notebook_shows_the_picture(lab):
    page = lab.open("saved.ipynb")
    picture = page.locator(".harmony-chart-static img")
    picture.wait_for(timeout=30_000)
    assert picture.evaluate("img => img.naturalWidth") > 0
    assert page.locator(".vega-embed").count() == 0  # untrusted: no script ran
    page.locator(".jp-OutputArea-output").first.screenshot(path=ARTIFACTS / "saved-untrusted.png")
    _no_requests_blocked(lab)
