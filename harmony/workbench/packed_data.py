"""A chart's data rows sent to the page as columns, and unpacked there.

A Vega-Lite dataset is a list of row objects, so its JSON repeats every field
name in every row, and every repeated text (a timeline's lane, its task kind
and what that kind means) in full. The explorer's default timeline is 2,163
rows of 15 fields: 780 kB of JSON, parsed twice in the page on every change
(the kernel's message, then the spec), with a garbage collection after.
Columns, texts written once each with a code per row, carry the same rows in
a fraction of that (bench/RESULTS.md); :data:`UNPACK_JS` turns them back into
rows in the page before vega sees the spec.

Only the JSON written into a page is packed: the charts' specs (``to_dict()``,
the tests' rules, saved specs) keep their rows."""

from __future__ import annotations

#: datasets with fewer rows stay rows (packing them would save next to nothing)
PACK_FROM_ROWS = 64
#: the key that marks a packed dataset: {PACKED: {field: column}, "rows": n}
PACKED = "harmony_columns"


def packed(spec: dict) -> dict:
    """``spec`` with each of its top-level datasets of :data:`PACK_FROM_ROWS` rows
    or more, whose rows all have the same fields, written as columns (the rest as
    they are). A column of texts, or of texts and nulls, with repeats is written
    as ``{"values": [each text once], "codes": [an index per row]}``; any other
    column as a list."""
    datasets = spec.get("datasets")
    if not isinstance(datasets, dict):
        return spec
    return {**spec, "datasets": {name: _columns(rows) for name, rows in datasets.items()}}


def _columns(rows):
    if not isinstance(rows, list) or len(rows) < PACK_FROM_ROWS:
        return rows
    if not all(isinstance(row, dict) for row in rows):
        return rows
    fields = list(rows[0])
    if any(len(row) != len(fields) or any(f not in row for f in fields) for row in rows):
        return rows  # rows with fields of their own: a column would invent the missing ones
    return {PACKED: {f: _column([row[f] for row in rows]) for f in fields}, "rows": len(rows)}


def _column(values: list):
    if not all(v is None or type(v) is str for v in values):
        return values
    distinct = list(dict.fromkeys(values))
    if len(distinct) > len(values) // 2:
        return values  # mostly different texts: codes would only add to them
    code = {v: i for i, v in enumerate(distinct)}
    return {"values": distinct, "codes": [code[v] for v in values]}


#: a JavaScript function expression: the spec with its packed datasets as rows again,
#: each row's fields in the order they had
UNPACK_JS = """function (spec) {
  var sets = spec.datasets || {};
  Object.keys(sets).forEach(function (name) {
    var packed = sets[name] && sets[name].%(key)s;
    if (!packed) return;
    var fields = Object.keys(packed);
    var columns = fields.map(function (field) {
      var c = packed[field];
      return Array.isArray(c) ? c : c.codes.map(function (i) { return c.values[i]; });
    });
    var n = sets[name].rows, rows = new Array(n);
    for (var i = 0; i < n; i++) {
      var row = {};
      for (var j = 0; j < fields.length; j++) row[fields[j]] = columns[j][i];
      rows[i] = row;
    }
    sets[name] = rows;
  });
  return spec;
}""" % {"key": PACKED}
