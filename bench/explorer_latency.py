"""How long the explorer (``notebooks/01_explorer.ipynb``) takes to answer a control.

Two measurements, one per mode:

* ``--browser`` (the default): JupyterLab on 127.0.0.1 and headless Chromium
  (Playwright, the system's Chromium; every request that does not go to
  127.0.0.1 is aborted, as in ``tests/test_browser.py``). The notebook runs
  with its quick parameters; then each control is changed in the page as a
  reader would, and a MutationObserver on the explorer's output reports the
  milliseconds from the change to the kernel's new output arriving (``swap``:
  the output area's content replaced; the explorer keeps the old output on
  screen until the new chart is drawn), to the first visible change (``first``:
  new content on screen) and to the last (the chart drawn, then nothing more
  for a second). ``swaps`` counts how many times the output area's content was
  replaced (1: the update comes in one piece).
  "Run for real" is pressed after the GPT-2 blocks slider moves: first = its
  progress line, last = its charts. Each change comes a second after the last
  one is drawn, time enough for the explorer's workers to simulate the rows of
  the settings one step away (``harmony.workbench.row_pool.ahead``), where it
  does (``--ahead on``; by default with 4 cores or more; ``--ahead off``: each
  change simulates all it needs when it comes).
* ``--in-process``: the same changes made on a :class:`PackExplorer` and a
  :class:`RunForReal` in Python, no browser: seconds of Python per change (the
  compute, the chart and the HTML), the median of ``--repeat`` rounds (the
  first round fills the caches the later rounds may use: both are printed),
  and of that the seconds spent in the simulator (``play``).

A benchmark, not a test: it prints numbers. Run from the repository root::

    python bench/explorer_latency.py --browser [--ahead on|off] [--screenshots DIR]
    python bench/explorer_latency.py --in-process --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from cpu_quota import cpu_quota

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_explorer.ipynb"
#: (what is done, control label, how): the changes the bench makes, in order
CHANGES = [
    ("layers per pack 2 -> 3", "layers per pack", ("key", "ArrowRight")),
    ("policy -> harmony-dp", "policy", ("select", "harmony-dp")),
    ("policy -> harmony-pp", "policy", ("select", "harmony-pp")),
    ("bwd microbatch 8 -> 4", "bwd microbatch", ("type", "4")),
    ("model -> gpt2-xl", "model", ("select", "gpt2-xl")),
    ("hardware -> h100-pcie5", "hardware", ("select", "h100-pcie5")),
    ("hardware -> paper-4x1080ti", "hardware", ("select", "paper-4x1080ti")),
    ("host memory -> 75%", "host memory", ("select", "75%")),
    ("disk -> NVMe", "disk", ("select", "NVMe")),
]
#: in-process: the same changes as attribute -> value
VALUES = [
    ("pack_size", 3),
    ("policy", "harmony-dp"),
    ("policy", "harmony-pp"),
    ("bwd_microbatch", 4),
    ("model", "gpt2-xl"),
    ("hardware", "h100-pcie5"),
    ("hardware", "paper-4x1080ti"),
    ("host_memory", "75%"),
    ("disk", "nvme"),
]
QUIET_S = 1.0  #: no change in the output for this long: the update is over

WATCH = """([root, label]) => {
  window.__changes = window.__changes || {};
  const log = window.__changes[label] = {start: performance.now(), times: [], first: null};
  // visible: an output that was not there at the start, not hidden behind the old one
  const children = () => [...root.querySelectorAll(".jp-OutputArea-child")];
  children().forEach(c => { c.__old = true; });
  const shown = c => !c.__old && !c.querySelector('.harmony-whole[style*="none"]');
  const obs = new MutationObserver(() => {
    const now = performance.now();
    log.times.push(now);
    if (log.first === null && children().some(shown)) log.first = now;
  });
  obs.observe(root, {subtree: true, childList: true, characterData: true, attributes: true});
  // a swap: the kernel replaced what the output area holds (one batch of its children)
  log.swaps = 0;
  const area = root.querySelector(".jp-OutputArea") || root;
  const swaps = new MutationObserver(() => { log.swaps += 1; });
  swaps.observe(area, {childList: true});
  (window.__observers || []).forEach(o => o.disconnect());
  window.__observers = [obs, swaps];
}"""


# ---- in process ------------------------------------------------------------------------------
def in_process(repeat: int) -> None:
    from harmony.workbench import play
    from harmony.workbench.widgets import PackExplorer, RunForReal

    simulating = [0.0]  # seconds in the simulator (its graph built and played)

    def timed_play(*args, _play=play.play):
        t0 = time.perf_counter()
        try:
            return _play(*args)
        finally:
            simulating[0] += time.perf_counter() - t0

    play.play = timed_play
    rounds: dict[str, list[float]] = {}
    simulated: dict[str, list[float]] = {}
    for _ in range(repeat):
        explorer = PackExplorer()
        explorer.widget()  # wired: every change draws, as in the notebook
        for (what, _, _), (name, value) in zip(CHANGES, VALUES):
            simulating[0], t0 = 0.0, time.perf_counter()
            getattr(explorer, name).value = value
            rounds.setdefault(what, []).append(time.perf_counter() - t0)
            simulated.setdefault(what, []).append(simulating[0])
        real = RunForReal(steps=2)
        real.widget()
        real.blocks.value = 3
        t0 = time.perf_counter()
        real.run_button.click()
        rounds.setdefault("Run for real (3 blocks, 2 steps)", []).append(time.perf_counter() - t0)
    print(f"{'change':36s} {'first round s':>14s} {'median s':>9s} {'simulating s':>13s}")
    for what, seconds in rounds.items():
        sim = statistics.median(simulated.get(what, [float("nan")]))
        print(f"{what:36s} {seconds[0]:14.3f} {statistics.median(seconds):9.3f} {sim:13.3f}")


# ---- in the browser ----------------------------------------------------------------------------
def _lab(root: Path, home: Path) -> tuple[subprocess.Popen, str, str]:
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    token = secrets.token_hex(16)
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none", "autoStartDefaultKernel": True})
    )
    env = {k: v for k, v in os.environ.items() if k != "HARMONY_CHARTS"}
    env.update(
        PYTHONPATH=str(ROOT),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTER_DATA_DIR=str(home / "data"),
    )
    args = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={number}",
        "--ServerApp.allow_root=True",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
    ]
    log = (home / "lab.log").open("w")
    server = subprocess.Popen(args, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{number}"
    for _ in range(180):
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                return server, base, token
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-2000:]}")


#: every code cell has run: each prompt shows its execution count
ALL_RAN = r"""() => {
  const prompts = [...document.querySelectorAll(".jp-CodeCell .jp-InputArea-prompt")];
  return prompts.length > 0 && prompts.every(p => /^\[\d+\]:$/.test(p.textContent.trim()));
}"""


def _run_all(page) -> None:
    """Run > Run All Cells, then wait (up to 10 minutes) until every cell has run."""
    page.locator(".lm-MenuBar").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu").get_by_text("Run All Cells", exact=True).click()
    page.wait_for_function(ALL_RAN, timeout=600_000, polling=1000)


def _measure(page, root, label: str, act) -> tuple[float, float, float, int]:
    """ms to the first change of ``root`` after ``act()`` (the kernel's output in), to
    its first visible change and to its last, and how many times the kernel
    replaced what it shows."""
    page.evaluate(WATCH, [root.element_handle(), label])
    act()
    deadline, last_seen, seen_at = time.monotonic() + 120, None, 0.0
    while time.monotonic() < deadline:
        time.sleep(0.25)
        log = page.evaluate("l => window.__changes[l]", label)
        # drawn: the chart, or a message without one; not a progress line
        drawn = not root.locator(".harmony-progress").count() and (
            root.locator(".vega-embed.harmony-drawn").count()
            or not root.locator(".harmony-chart").count()
        )
        if log["times"] and drawn:
            if last_seen == len(log["times"]) and time.monotonic() - seen_at >= QUIET_S:
                break
            if last_seen != len(log["times"]):
                last_seen, seen_at = len(log["times"]), time.monotonic()
    times = [t - log["start"] for t in log["times"]]
    if not times:
        return float("nan"), float("nan"), float("nan"), 0
    first = log["first"] - log["start"] if log["first"] is not None else float("nan")
    return times[0], first, times[-1], log["swaps"]


def _act(page, widget, label: str, how: tuple[str, str]):
    kind, value = how
    control = widget.locator(
        ".widget-inline-hbox", has=page.locator(".widget-label", has_text=label)
    ).first
    if kind == "key":
        handle = control.locator(".noUi-handle")
        handle.focus()
        return lambda: page.keyboard.press(value)
    if kind == "type":
        box = control.locator("input")
        box.fill(value)  # not sent until Enter
        return lambda: box.press("Enter")
    select = control.locator("select")
    options = [o.strip() for o in select.locator("option").all_inner_texts()]
    choice = next(o for o in options if o.startswith(value))
    return lambda: select.select_option(label=choice)


def browser(screenshots: Path | None = None) -> None:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("HARMONY_CHROMIUM") or shutil.which("chromium")
    if not chromium:
        raise SystemExit("no Chromium found: apt-get install chromium, or set HARMONY_CHROMIUM")
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        root = home / "root"
        root.mkdir()
        nb = json.loads(NOTEBOOK.read_text())
        for cell in nb["cells"]:  # results of the batch cell go to the temporary folder
            if "parameters" in cell.get("metadata", {}).get("tags", []):
                cell["source"] = "".join(cell["source"]) + f'\nout_dir = "{home / "out"}"\n'
        (root / "explorer.ipynb").write_text(json.dumps(nb))
        server, base, token = _lab(root, home)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
                )
                context = browser.new_context(viewport={"width": 1400, "height": 1800})
                context.route(
                    "**/*",
                    lambda r: (
                        r.continue_()
                        if urlparse(r.request.url).hostname == "127.0.0.1"
                        else r.abort()
                    ),
                )
                page = context.new_page()
                page.goto(f"{base}/lab/workspaces/bench/tree/explorer.ipynb?reset&token={token}")
                page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"Idle")).first.wait_for(
                    timeout=120_000
                )
                _run_all(page)
                page.locator(".widget-output .vega-embed.harmony-drawn").first.wait_for(
                    timeout=120_000
                )
                _report(page, screenshots)
                browser.close()
        finally:
            _stop(server)


def _stop(server: subprocess.Popen) -> None:
    """JupyterLab asked to stop, then made to if it is still there after 20 s."""
    server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=20)
    server.kill()  # nothing when it has stopped


#: the explorer's texts wider than the box they are in (cut, or hidden past its edge)
CUT = """root => {
  const edge = root.getBoundingClientRect().right + 1;
  const texts = [...root.querySelectorAll("button, caption, td, th, .widget-label")];
  return texts
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > edge)
    .map(e => e.tagName.toLowerCase() + ": " + e.textContent.trim().slice(0, 60));
}"""


def _report(page, screenshots: Path | None) -> None:
    explorer, real = page.locator(".widget-vbox").first, page.locator(".widget-vbox").nth(1)
    if screenshots:
        screenshots.mkdir(parents=True, exist_ok=True)
        explorer.screenshot(path=screenshots / "explorer.png")
    cut = explorer.evaluate(CUT)
    print(
        f"texts cut at 1400 px (the default width): {len(cut)}" + "".join(f"\n  {c}" for c in cut)
    )
    output = explorer.locator(".widget-output").first
    print(f"{'change':36s} {'swap ms':>9s} {'first ms':>9s} {'last ms':>9s} {'swaps':>6s}")
    for what, label, how in CHANGES:
        act = _act(page, explorer, label, how)
        swap, first, last, steps = _measure(page, output, what, act)
        print(f"{what:36s} {swap:9.0f} {first:9.0f} {last:9.0f} {steps:6d}")
    _act(page, real, "GPT-2 blocks", ("key", "ArrowLeft"))()
    time.sleep(1)
    button = real.locator("button", has_text="Run for real")
    swap, first, last, steps = _measure(
        page, real.locator(".widget-output").first, "run", lambda: button.click()
    )
    print(
        f"{'Run for real (blocks one fewer)':36s} {swap:9.0f} {first:9.0f} {last:9.0f} {steps:6d}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--browser", action="store_true", help="in JupyterLab (the default)")
    mode.add_argument("--in-process", action="store_true", help="Python time per change")
    parser.add_argument("--repeat", type=int, default=3, help="in-process rounds")
    parser.add_argument("--screenshots", type=Path, help="browser: a picture of the explorer here")
    parser.add_argument(
        "--ahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="rows of the settings one step away simulated ahead of a change (on), or not "
        "(off: each change simulates all it needs when it comes); auto: the explorer's "
        "default, on with 4 cores or more (HARMONY_EXPLORER_AHEAD)",
    )
    parser.add_argument(
        "--cpus",
        type=float,
        help="a model of a slower machine: everything the bench runs shares this many "
        "cores' worth of CPU time (a Linux cgroup quota; needs root), e.g. 0.5",
    )
    args = parser.parse_args()
    # read by harmony.workbench.row_pool, here and in the notebook's kernel
    os.environ["HARMONY_EXPLORER_AHEAD"] = {"auto": "auto", "on": "1", "off": "0"}[args.ahead]
    with cpu_quota(args.cpus):
        if args.in_process:
            in_process(args.repeat)
        else:
            browser(args.screenshots)


if __name__ == "__main__":
    main()
