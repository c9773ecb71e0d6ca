"""How notebooks display altair charts without internet, and the altair import.

Altair's own HTML output loads vega from a CDN, and JupyterLab's built-in vega
renderer does not draw altair 6's charts. Importing this module (every chart
module imports it) therefore switches altair to one of these renderers
(:func:`use_renderer`; the ``HARMONY_CHARTS`` environment variable picks one):

* ``interactive`` (default): HTML that draws the chart with vega-embed, its
  JavaScript inlined from vl-convert (nothing is fetched), with tooltips and,
  on swap timelines, zoom and pan. The same HTML holds an SVG picture of the
  chart, shown until the script runs: a notebook opened untrusted (JupyterLab
  then runs no scripts), or a viewer without JavaScript, still shows the chart.
  Charts with many data rows are drawn on a canvas, the others as SVG
  (:func:`embed_options`).
* ``static``: only the SVG picture, no JavaScript (smaller notebooks).
* ``altair``: altair's renderer as it was before (e.g. online, or with a
  JupyterLab extension that draws vega-lite 6).

Altair and vl-convert come with the ``notebooks`` extra; without them this
module still imports, and charts raise a message saying what to install.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import importlib.util
import json
import os
import uuid
import warnings
from pathlib import Path

from ..errors import HarmonyError
from .live_update import UPDATE_JS, shape_key, values_as_params
from .packed_data import UNPACK_JS, packed

#: environment variable read by :func:`use_renderer` when no mode is given
RENDERER_ENV = "HARMONY_CHARTS"
RENDERERS = ("interactive", "static", "altair")
#: vega-embed options: the export menu (PNG/SVG, works offline), no links to online editors
EMBED_OPTIONS = {
    "renderer": "svg",
    "actions": {"export": True, "source": False, "compiled": False, "editor": False},
}
#: charts with this many data rows or more are drawn on a canvas: Chromium takes a second or
#: more to lay out thousands of SVG elements (the explorer's timeline), a canvas a fraction
#: of that (bench/RESULTS.md); smaller charts stay SVG, sharper and searchable. The export
#: menu draws SVG either way.
CANVAS_FROM_ROWS = 1000


def embed_options(spec: dict) -> dict:
    """:data:`EMBED_OPTIONS` for the vega-lite ``spec``, with the canvas renderer
    when it has :data:`CANVAS_FROM_ROWS` data rows or more."""
    if data_rows(spec) < CANVAS_FROM_ROWS:
        return EMBED_OPTIONS
    return {**EMBED_OPTIONS, "renderer": "canvas"}


def data_rows(spec) -> int:
    """How many data rows ``spec`` carries: its named datasets and the inline
    ``values`` of its (layered, concatenated) parts."""
    if isinstance(spec, list):
        return sum(data_rows(part) for part in spec)
    if not isinstance(spec, dict):
        return 0
    rows = sum(len(v) for v in (spec.get("datasets") or {}).values() if isinstance(v, list))
    values = (spec.get("data") or {}).get("values") if isinstance(spec.get("data"), dict) else None
    rows += len(values) if isinstance(values, list) else 0
    parts = ("layer", "vconcat", "hconcat", "concat", "spec")
    return rows + sum(data_rows(spec[k]) for k in parts if k in spec)


def load_altair():
    """The altair module, or a HarmonyError saying how to install it."""
    try:
        import altair as alt
    except ImportError:  # pragma: no cover - depends on the install
        raise HarmonyError("charts need altair: pip install -e '.[notebooks]'") from None
    return alt


class _State:
    mode: str | None = None  #: the mode enabled by use_renderer
    previous: str | None = None  #: altair's renderer before ours, restored by "altair"


def use_renderer(mode: str | None = None) -> str:
    """Display altair charts in ``mode`` (see the module docstring); None reads
    ``HARMONY_CHARTS`` and defaults to ``"interactive"``. Returns the mode."""
    mode = (mode or os.environ.get(RENDERER_ENV) or "interactive").strip().lower()
    if mode not in RENDERERS:
        raise HarmonyError(
            f"unknown chart renderer {mode!r} (from {RENDERER_ENV} or the argument); "
            f"use one of {', '.join(RENDERERS)}"
        )
    alt = load_altair()
    if mode == "altair":
        if _State.previous is not None:
            alt.renderers.enable(_State.previous)
    else:
        if not alt.renderers.active.startswith("harmony-"):
            _State.previous = alt.renderers.active
        alt.renderers.register(f"harmony-{mode}", functools.partial(mimebundle, mode=mode))
        alt.renderers.enable(f"harmony-{mode}")
    _State.mode = mode
    return mode


def mimebundle(spec: dict, mode: str = "interactive", picture: bool = True, **_) -> dict[str, str]:
    """What a notebook stores for the vega-lite ``spec``: HTML that draws it
    (``interactive``: with an SVG picture inside unless ``picture`` is False)
    or the picture alone (``static``). Extra keyword arguments (altair's
    renderer options) are ignored."""
    title = spec.get("title")
    text = title.get("text") if isinstance(title, dict) else title
    plain = f"<chart: {' '.join(text) if isinstance(text, list) else text or 'untitled'}>"
    if mode == "static":
        return {
            "text/html": f'<div class="harmony-chart">{_picture(spec)}</div>',
            "text/plain": plain,
        }
    return {"text/html": _interactive_html(spec, picture), "text/plain": plain}


class Displayable:
    """A chart shown by the current mode; ``picture=False`` leaves the SVG
    picture out of interactive HTML (for live widget outputs, which need a
    running kernel anyway: it saves a vl-convert render on every redraw)."""

    def __init__(self, chart, picture: bool = True):
        self.chart, self.picture = chart, picture

    def _repr_mimebundle_(self, include=None, exclude=None):
        mode = _State.mode or use_renderer()
        if mode == "altair":
            return self.chart._repr_mimebundle_(include, exclude)
        return mimebundle(self.chart.to_dict(), mode, self.picture)


def live_bundle(chart, below: str = "") -> dict[str, str]:
    """What a widget's output shows of ``chart`` (an altair chart, or its
    Vega-Lite spec as a dict) on every redraw: interactive HTML without the
    picture and without vega's script, which the widget's :func:`loader_bundle`
    brings once (nearly a megabyte less per redraw). The spec is not validated
    again: the chart's parts were when they were made.

    The update appears in one step: what the output area showed before (a
    chart and the HTML ``below`` it, or a :func:`live_html` bundle) stays on
    screen until the new chart is drawn, then both go at once."""
    mode = _State.mode or use_renderer()
    spec = chart if isinstance(chart, dict) else chart.to_dict(validate=False)
    if mode == "altair":
        bundle = load_altair().renderers.get()(spec)
        bundle = bundle[0] if isinstance(bundle, tuple) else bundle
        return {**bundle, "text/html": bundle.get("text/html", "") + below}
    if mode == "static":
        shown = mimebundle(spec, mode)
        return {**shown, "text/html": shown["text/html"] + below}
    html = _interactive_html(spec, picture=False, script=False, below=below)
    return {"text/html": html, "text/plain": ""}


def live_html(text: str) -> dict[str, str]:
    """HTML for a widget's output in place of a :func:`live_bundle` chart (a
    message): shown at once, and what the charts it replaces leave is let go."""
    div = f"harmony-shown-{uuid.uuid4().hex}"
    return {
        "text/html": f"""<div id="{div}">{text}</div>
<script type="text/javascript">
(function () {{
  var whole = document.getElementById("{div}");
  var area = whole && whole.parentElement.closest("{_AREAS}");
  if (area) {{ area.harmonyLast = whole; {_LET_GO} }}
}})();
</script>""",
        "text/plain": "",
    }


def loader_bundle() -> dict[str, str]:
    """HTML that loads vega-embed into the page once, for the :func:`live_bundle`
    charts shown beside it (they wait for it)."""
    return {
        "text/html": f"""<script type="text/javascript">
if (!window.vegaEmbed) {{ (function () {{ {vega_script()}
}})(); }}
</script>""",
        "text/plain": "",
    }


def _vl_version() -> str:
    """vl-convert's name of the vega-lite version altair writes (``v6_4`` for 6.4.x)."""
    return "_".join(load_altair().SCHEMA_VERSION.split(".")[:2])


def _picture(spec: dict) -> str:
    """An ``<img>`` of the chart, rendered by vl-convert: safe HTML that no
    sanitizer removes, so untrusted notebooks show it. A spec vl-convert cannot
    render gets a line saying so (the live chart, if scripts run, is unaffected)."""
    import vl_convert as vlc

    try:
        svg = vlc.vegalite_to_svg(spec, vl_version=_vl_version())
    except ValueError as err:
        return f"<pre>no picture of this chart: {html.escape(str(err)[:300])}</pre>"
    data = base64.b64encode(svg.encode()).decode()
    return f'<img src="data:image/svg+xml;base64,{data}" style="max-width: 100%" alt="chart">'


@functools.cache
def vega_script() -> str:
    """vega, vega-lite and vega-embed in one script, from vl-convert. Building
    it takes seconds, so it is kept in the user's cache folder per version."""
    import vl_convert as vlc

    version = _vl_version()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harmony"
    path = cache / f"vega-embed-vlc{vlc.__version__}-{version}.js"
    with contextlib.suppress(OSError):
        cached = path.read_text()
        if cached.rstrip().endswith(";") and "window.vegaEmbed" in cached:  # whole, not cut short
            return cached
    script = vlc.javascript_bundle(vl_version=version)
    with contextlib.suppress(OSError):  # a read-only home only costs the rebuild
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(script)
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return script


_NOTE = (
    '<div style="color: #888; font-size: 11px">A picture of the chart: run the cell, or '
    "trust the notebook, for tooltips and zoom.</div>"
)


#: how long a chart without vega's script waits for a loader to bring it
_WAIT_MS = 30_000


#: the elements that hold a notebook's outputs (JupyterLab's, the classic notebook's)
_AREAS = ".jp-OutputArea, .output_area"

# A vega view listens on the window and the document (a zoom's drag, the export menu)
# until it is finalized. The charts of an output area that are no longer in it are let
# go here, or each redraw would keep every chart before it alive, data and all
# (megabytes per change of an explorer, and ever longer garbage collections).
_LET_GO = """area.harmonyViews = (area.harmonyViews || []).filter(function (shown) {
    if (area.contains(shown.el)) return true;
    shown.finalize();
    return false;
  });"""


# What a live output area showed last (``cover``), taken out when this output came, back on
# screen until this chart is drawn; ``show()`` then puts the chart in its place (false if a
# newer output replaced this one meanwhile). Not in a notebook's cells: they show a picture
# meanwhile.
_COVER = """if (cover && cover !== whole && !area.contains(cover)) {
    whole.parentNode.insertBefore(cover, whole);
    whole.style.display = "none";
  } else {
    cover = null;
  }
  function show() {
    if (area && !area.contains(whole)) return false;
    if (cover) cover.remove();
    whole.style.display = "";
    if (area) area.harmonyLast = whole;
    return true;
  }"""


# The chart on screen, of the same shape (its key): its view takes the new data, titles and
# scale bounds (:mod:`.live_update`), then moves into this output as that takes the old
# one's place.
_IN_PLACE = (
    """var drawn = cover && cover.querySelector(".vega-embed.harmony-drawn");
  if (drawn && drawn.harmonyKey === key && drawn.harmonyView) {
    (%s)(drawn.harmonyView, spec)
      .then(function () {
        if (area && !area.contains(whole)) return;  // a newer output took over: it moves it
        root.appendChild(drawn);
        show();
      })
      .catch(embed);  // a view that would not take them: a new one
    return;
  }"""
    % UPDATE_JS
)

_FAILED = """function failed(err) {
    show();
    var msg = document.createElement("pre");
    msg.style.color = "#c0392b";
    msg.textContent = "the interactive chart failed: " + err;
    root.appendChild(msg);
  }"""


def _interactive_html(
    spec: dict, picture: bool = True, script: bool = True, below: str = ""
) -> str:
    """A div (holding the picture, if any, then the HTML ``below``) and a script
    that loads the inlined vega-embed once per page (``script=False``: waits for
    a :func:`loader_bundle` to) and draws the live chart in it.

    While the chart is drawn, what the output area showed last (a chart drawn by
    this script, a :func:`live_html`) covers it: the reader sees the old output,
    then the new one whole, never a half-built one."""
    div = f"harmony-chart-{uuid.uuid4().hex}"
    static = f'<div class="harmony-chart-static">{_picture(spec)}{_NOTE}</div>' if picture else ""
    # The spec goes in as JSON text in a data block, for JSON.parse: V8 parses JSON faster
    # than the same object written as a JavaScript literal (it need not compile it), and the
    # text needs no escaping but "</", which would end the element early ("<\/" is the same
    # string in JSON).
    # Its datasets go as columns (:mod:`.packed_data`), rows again in the page. A live
    # chart's titles go as parameters: one of the same shape as the chart on screen updates
    # that chart's view (:mod:`.live_update`).
    key = ""
    if not script:
        spec = values_as_params(spec)
        key = shape_key(spec)
    spec_json = json.dumps(packed(spec)).replace("</", "<\\/")
    # The bundle declares top-level constants: it runs once per page, inside a function.
    load = (
        f"if (!window.vegaEmbed) {{ (function () {{ {vega_script()}\n  }})(); }}" if script else ""
    )
    chart = f'<div class="harmony-chart" id="{div}">{static}</div>'
    return f"""<div class="harmony-whole" id="{div}-whole">{chart}{below}</div>
<script type="application/json" id="{div}-spec">{spec_json}</script>
<script type="text/javascript">
(function () {{
  // by id; by place where the output is not yet in the page when its script runs
  var data =
    document.getElementById("{div}-spec") || document.currentScript.previousElementSibling;
  var whole = document.getElementById("{div}-whole") || data.previousElementSibling;
  var root = whole.firstChild;
  var area = whole.parentElement && whole.parentElement.closest("{_AREAS}");
  var cover = {"area && area.harmonyLast" if not script else "null"};
  {_COVER}
  {load}
  var waited = 0;
  (function draw() {{
  if (!window.vegaEmbed) {{
    waited += 50;
    if (waited < {_WAIT_MS}) return setTimeout(draw, 50);
    show();
    root.textContent = "the interactive chart failed: vega-embed was not loaded";
    return;
  }}
  var spec = ({UNPACK_JS})(JSON.parse(data.textContent)), key = "{key}";
  {_IN_PLACE}
  embed();
  function embed() {{
  var live = root.appendChild(document.createElement("div"));
  window.vegaEmbed(live, spec, {json.dumps(embed_options(spec))})
    .then(function (result) {{
      if (!show()) return result.finalize();
      // drawn: marked, and the view kept for checks that read what a canvas shows (toSVG)
      // and for the next chart of the same shape (its key)
      live.harmonyView = result.view;
      live.harmonyKey = key;
      live.classList.add("harmony-drawn");
      if (area) {{
        {_LET_GO}
        area.harmonyViews.push({{el: live, finalize: result.finalize}});
      }}
      var picture = root.querySelector(".harmony-chart-static");
      if (picture) picture.remove();
    }})
    .catch(failed);
  }}
  }})();
  {_FAILED}
}})();
</script>"""


def build_from_dict_table_once() -> bool:
    """Make altair build its table of vega-lite classes once, not per encoding.

    Altair 6 turns every encoding (``x="policy:N"``) into its class through
    ``SchemaBase.from_dict``, which first hashes the JSON of every one of
    vega-lite's schema classes (thousands) into a table, and drops the table
    after: most of the time an explorer spends building its charts. The classes
    never change while Python runs, so the table is kept per set of classes.
    Returns whether altair has the hook (a later altair without it is left as
    it is: only slower)."""
    try:
        from altair.utils import schemapi

        table_maker = schemapi._FromDict
    except (ImportError, AttributeError):  # pragma: no cover - depends on the install
        return False
    if getattr(table_maker, "_harmony_once", False):
        return True
    build = table_maker.__init__
    tables: dict[tuple, dict] = {}

    def __init__(self, wrapper_classes, /) -> None:
        key = tuple(wrapper_classes)
        if key not in tables:
            build(self, key)
            tables[key] = self.class_dict
        self.class_dict = tables[key]

    table_maker.__init__ = __init__
    table_maker._harmony_once = True
    return True


if importlib.util.find_spec("altair") is not None:  # notebooks draw without internet from here on
    build_from_dict_table_once()
    try:
        use_renderer()
    except HarmonyError as err:  # a mistyped HARMONY_CHARTS must not break the import
        warnings.warn(f"{err}; using the interactive renderer", stacklevel=2)
        use_renderer("interactive")
