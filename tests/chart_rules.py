"""What every chart of the project must have for a reader who has not seen the
code: a title, a title on every axis and every legend, none of them a raw
``snake_case`` column name, and no Python repr (``['a', 'b']``, ``(0, 4)``)
in any text it shows. Checked on the Vega spec vega-lite compiles a chart to
(:func:`problems`), the one the browser draws, so layered, concatenated and
faceted charts are judged as drawn."""

from __future__ import annotations

import json
import re

#: text that looks like a Python repr: a list or tuple of strings or numbers, a dict
REPR = re.compile(r"\[['\"\d]|\((\d+|'[^']*'), |\{'|\bnp\.|object at 0x|dtype\(|\bnan\b|\bNone\b")
#: a raw column name: lower-case words joined by underscores
SNAKE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)+$")


def compile_vega(vega_lite: dict) -> dict:
    import vl_convert as vlc

    from harmony.workbench.display import _vl_version

    vega = vlc.vegalite_to_vega(vega_lite, vl_version=_vl_version())
    return json.loads(vega) if isinstance(vega, str) else vega


def _text(value) -> str:
    if isinstance(value, dict):  # {"text": ..., "subtitle": ...} or a signal
        return " ".join(_text(value.get(k)) for k in ("text", "subtitle") if value.get(k))
    if isinstance(value, list):
        return " ".join(map(_text, value))
    return "" if value is None else str(value)


def _walk(node, path="spec"):
    """Every dict of ``node`` with where it is."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def _titled(what: str, where: str, title) -> list[str]:
    text = _text(title).strip()
    if not text:
        return [f"{what} without a title at {where}"]
    out = []
    if SNAKE.match(text):
        out.append(f"{what} titled with a raw column name {text!r} at {where}")
    if REPR.search(text):
        out.append(f"{what} title {text!r} looks like Python repr at {where}")
    return out


def _has_title(spec: dict) -> bool:
    if _text(spec.get("title")).strip():
        return True
    parts = spec.get("vconcat") or spec.get("hconcat") or spec.get("concat")
    return bool(parts) and all(_has_title(p) for p in parts)


def problems(vega_lite: dict) -> list[str]:
    """What a reader would miss in the chart ``vega_lite`` (its ``to_dict()``)."""
    out = [] if _has_title(vega_lite) else ["the chart has no title"]
    vega = compile_vega(vega_lite)
    for where, node in _walk(vega):
        for axis in node.get("axes", []) if isinstance(node.get("axes"), list) else []:
            if axis.get("labels") is False and axis.get("grid"):
                continue  # a grid drawn apart from its axis
            out += _titled(f"{axis.get('orient')} axis", where, axis.get("title"))
        for legend in node.get("legends", []) if isinstance(node.get("legends"), list) else []:
            out += _titled("legend", where, legend.get("title"))
        if "title" in node and where != "spec" and isinstance(node["title"], (str, dict)):
            text = _text(node["title"])
            if REPR.search(text):
                out.append(f"title {text!r} looks like Python repr at {where}")
    root = _text(vega.get("title"))
    if REPR.search(root):
        out.append(f"title {root!r} looks like Python repr")
    out += _repr_in_data(vega_lite)
    return out


def _shown_fields(vega_lite: dict) -> set[str]:
    """The fields a chart shows as text: labels on axes, in legends, text marks, tooltips."""
    fields = set()
    for _, node in _walk(vega_lite):
        if isinstance(node.get("field"), str) and node.get("type") in ("nominal", "ordinal"):
            fields.add(node["field"])
    return fields


def _repr_in_data(vega_lite: dict) -> list[str]:
    shown = _shown_fields(vega_lite)
    out = []
    for rows in (vega_lite.get("datasets") or {}).values():
        for row in rows:
            for k in shown & set(row):
                # a tooltip written out is an object: {title: text}
                texts = row[k].values() if isinstance(row[k], dict) else [row[k]]
                bad = [t for t in texts if isinstance(t, str) and REPR.search(t)]
                if bad:
                    out.append(f"{k}={bad[0]!r} looks like Python repr")
                    break
            if out:
                return out
    return out


#: for the browser (a statement for the body of an async function of the chart's element):
#: ``svgOf(root)`` gives ``[svg, done]``, the drawn chart as SVG. A chart drawn as SVG gives
#: its own; a chart drawn on a canvas (many data rows) gives the same Vega view drawn to SVG
#: (``view.toSVG()``, the scenegraph the canvas shows), put in the page unseen so that its
#: texts have sizes, and taken out by ``done()``. ``[null, ...]``: not drawn yet.
SVG_OF = r"""
  const svgOf = async root => {
    const own = root.querySelector(".vega-embed svg.marks");
    if (own) return [own, () => {}];
    const embed = [...root.querySelectorAll(".vega-embed")].find(e => e.harmonyView);
    if (!embed) return [null, () => {}];
    const box = document.body.appendChild(document.createElement("div"));
    box.style.cssText = "position: absolute; left: 0; top: 0; visibility: hidden";
    box.innerHTML = await embed.harmonyView.toSVG();
    return [box.querySelector("svg"), () => box.remove()];
  };
"""
#: the texts of the chart drawn in the element: its title and all its texts, one string each
DRAWN_TEXT = (
    "async root => {"
    + SVG_OF
    + r"""
  const [svg, done] = await svgOf(root);
  if (!svg) return {title: "", text: ""};
  const title = svg.querySelector(".role-title-text");
  const texts = [...svg.querySelectorAll("text")].map(t => t.textContent.trim()).filter(t => t);
  done();
  return {title: title ? title.textContent.trim() : "", text: texts.join("\n")};
}"""
)
#: for the browser: in a drawn chart's SVG, tick labels that overlap one another, axis and
#: legend titles missing, text that looks like Python repr, a title cut at the chart's edges
RENDERED = (
    "async root => {"
    + SVG_OF
    + r"""
  const [svg, done] = await svgOf(root);
  if (!svg) return ["no drawn chart"];
  try { return problemsOf(svg).concat(cutByItsOutput(root)); } finally { done(); }
  // a chart wider than the output it is in is cut at its right edge (a legend, a label)
  function cutByItsOutput(root) {
    const drawn = root.querySelector(".vega-embed canvas, .vega-embed svg.marks");
    const output = root.closest(".jp-OutputArea-output, .output_subarea");
    if (!drawn || !output) return [];
    const cut = drawn.getBoundingClientRect().right - output.getBoundingClientRect().right;
    return cut > 1 ? [`the chart is ${Math.round(cut)} px wider than its output, cut there`] : [];
  }
  function problemsOf(svg) {
  const out = [];
  const text = el => (el.textContent || "").trim();
  const repr = /\[['"\d]|\((\d+|'[^']*'), |\{'|object at 0x/;
  for (const t of svg.querySelectorAll("text")) {
    if (repr.test(text(t))) out.push("repr-looking text: " + text(t));
  }
  for (const axis of svg.querySelectorAll("g.role-axis")) {
    const labels = [...axis.querySelectorAll("g.role-axis-label text")]
      .filter(t => text(t) && t.getAttribute("opacity") !== "0");
    // vega writes "translate(x,y) rotate(a)": slanted labels are parallel lines, which
    // overlap when their anchors are closer than a line's height across the slant
    const place = t => {
      const m = /translate\(([-\d.e]+),\s*([-\d.e]+)\)(?:\s*rotate\(([-\d.e]+)\))?/
        .exec(t.getAttribute("transform") || "");
      return m ? {x: +m[1], y: +m[2], a: +(m[3] || 0) * Math.PI / 180} : null;
    };
    for (let i = 1; i < labels.length; i++) {
      for (let j = 0; j < i; j++) {
        const p = place(labels[i]), q = place(labels[j]);
        let hit;
        if (p && q && p.a !== 0 && p.a === q.a) {
          const across = Math.abs((p.x - q.x) * Math.sin(p.a) - (p.y - q.y) * Math.cos(p.a));
          hit = across + 1 < parseFloat(getComputedStyle(labels[i]).fontSize || "10");
        } else {
          const a = labels[i].getBoundingClientRect(), b = labels[j].getBoundingClientRect();
          hit = Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1
             && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
        }
        if (hit) out.push(`tick labels overlap: "${text(labels[i])}", "${text(labels[j])}"`);
      }
    }
    if (labels.length && !text(axis.querySelector("g.role-axis-title") || {}))
      out.push("an axis without a title, labels " + labels.slice(0, 3).map(text).join(", "));
  }
  for (const legend of svg.querySelectorAll("g.role-legend")) {
    if (!text(legend.querySelector("g.role-legend-title") || {}))
      out.push("a legend without a title");
  }
  if (!svg.querySelector("g.role-title-text text, g.role-title text"))
    out.push("a chart without a title");
  const box = svg.getBoundingClientRect();
  for (const t of svg.querySelectorAll("g.role-title-text text")) {
    const r = t.getBoundingClientRect();
    if (r.left < box.left - 1 || r.right > box.right + 1)
      out.push("a title wider than its chart: " + text(t));
  }
  return [...new Set(out)];
  }
}"""
)
