"""A live chart updated in place: when a widget's new chart differs from the one
on screen only in its data, its titles and the bounds of its numeric scales, the
page gives the drawn vega view the new ones instead of drawing a new view.

A new view costs the page vega-lite's compile, vega's parse of the result and
a new canvas (bench/RESULTS.md). A change of the layers per pack, of a
microbatch size or of the model changes only those. So they go into the spec as
parameters (:func:`values_as_params`), and the rest is summed up in a key
(:func:`shape_key`): a chart with the key of the one on screen updates that one
(:data:`UPDATE_JS`)."""

from __future__ import annotations

import hashlib
import json

#: the parameters that hold the values a view can change: this prefix, a kind, a number
PARAM = "harmony_live_"
#: the parts of a composed view that are views themselves
_VIEWS = ("vconcat", "hconcat", "concat", "layer")


def values_as_params(spec: dict) -> dict:
    """``spec`` with the title and subtitle of every view (not the titles of its
    axes and legends) and each number of a scale's domain read from a top-level
    parameter named :data:`PARAM`..., its value the text or number: the same
    chart, whose titles and scale bounds a view can change."""
    params: list[dict] = []

    def param(kind: str, value):
        name = f"{PARAM}{kind}_{len(params)}"
        params.append({"name": name, "value": value})
        return {"expr": name}

    def title(value):
        if isinstance(value, (str, list)):
            return {"text": param("title", value)}
        if isinstance(value, dict):
            return {
                k: param("title", v)
                if k in ("text", "subtitle") and isinstance(v, (str, list))
                else v
                for k, v in value.items()
            }
        return value

    def channel(definition):
        scale = definition.get("scale") if isinstance(definition, dict) else None
        domain = scale.get("domain") if isinstance(scale, dict) else None
        if not isinstance(domain, list) or not all(_number(v) for v in domain):
            return definition  # no scale, or a domain of names (which the chart's shape is)
        domain = [param("domain", v) for v in domain]
        return {**definition, "scale": {**scale, "domain": domain}}

    def view(node: dict) -> dict:
        node = dict(node)
        if "title" in node:
            node["title"] = title(node["title"])
        if isinstance(node.get("encoding"), dict):
            node["encoding"] = {c: channel(d) for c, d in node["encoding"].items()}
        for part in _VIEWS:
            if isinstance(node.get(part), list):
                node[part] = [view(p) if isinstance(p, dict) else p for p in node[part]]
        if isinstance(node.get("spec"), dict):  # a facet's
            node["spec"] = view(node["spec"])
        return node

    out = view(spec)
    if params:
        out["params"] = [*spec.get("params", []), *params]
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shape_key(spec: dict) -> str:
    """What a view of ``spec`` (as :func:`values_as_params` writes it) draws but its
    data and its parameters' values: charts of one key differ in nothing else."""
    params = [
        {k: v for k, v in p.items() if k != "value"} if p.get("name", "").startswith(PARAM) else p
        for p in spec.get("params", [])
    ]
    shape = {**{k: v for k, v in spec.items() if k != "datasets"}, "params": params}
    return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()


#: a JavaScript function expression: gives the drawn ``view`` the values of the
#: :data:`PARAM` parameters and the datasets of ``spec``, then runs it (a promise)
UPDATE_JS = """function (view, spec) {
  try {
    (spec.params || []).forEach(function (p) {
      if (p.name.indexOf("%(prefix)s") === 0) view.signal(p.name, p.value);
    });
    var sets = spec.datasets || {};
    Object.keys(sets).forEach(function (name) { view.data(name, sets[name]); });
  } catch (err) {
    return Promise.reject(err);  // e.g. a dataset the view does not have: drawn anew
  }
  return view.runAsync();
}""" % {"prefix": PARAM}
