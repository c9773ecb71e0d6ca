"""Words for what charts show: model names as a reader writes them, cases that
say what their numbers are ("GPT-2 XL, minibatch 16"), titles for table
columns, and tooltips whose numbers keep meaningful digits.

Every chart of the project takes its words from here, so a column is called
the same in every axis, legend and tooltip.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import pandas as pd

#: model families as their papers write them
_FAMILIES = {"gpt2": "GPT-2", "bert": "BERT", "resnet": "ResNet", "vgg": "VGG"}
#: sizes as their papers write them
_SIZES = {"xl": "XL", "large": "Large", "medium": "Medium", "tiny": "tiny"}

#: column -> its title with its unit; columns not listed get their name in words
TITLES: dict[str, str] = {
    "iteration_s": "iteration time (s)",
    "samples_per_s": "samples/s",
    "swap_gb": "host↔GPU GB per iteration",
    "swap_mb": "MB over the link per step",
    "host_gpu_gb": "host↔GPU GB per iteration",
    "gpu_gpu_gb": "GPU↔GPU GB per iteration",
    "pcie_gb": "PCIe GB per iteration",
    "w_in_gb": "weights loaded (GB)",
    "peak_memory_gb": "peak GPU memory (GB)",
    "peak_gb": "peak GPU memory (GB)",
    "search_s": "search time (s)",
    "microbatch": "microbatch size",
    "minibatch": "minibatch size",
    "microbatches": "microbatches per minibatch",
    "pack_size": "layers per pack",
    "layers_per_pack": "layers per pack",
    "n_gpus": "GPUs",
    "efficiency": "scaling efficiency",
    "karma_speedup": "baseline time / KARMA's",
    "total_s": "seconds to train every job",
    "speedup_vs_previous": "speedup over the rung below",
    "speedup_vs_bottom": "speedup over the bottom rung",
    "limited_by": "limited by",
    "simulated_s": "simulated iteration time (s)",
    "measured_s": "measured iteration time (s)",
    "simulated_peak_mb": "simulated peak memory (MB)",
    "measured_peak_mb": "measured peak memory (MB)",
    "read_GBps": "disk read bandwidth (GB/s)",
    "disk_read_gb": "disk reads per iteration (GB)",
    "lower_bound_by": "limited by",
    "gpu_idle_s": "GPU idle (s)",
    "link_GBps": "host↔GPU link (GB/s)",
    "GB": "GB per iteration",
}
#: numbers in tooltips and tables: three significant digits, no trailing zeros
NUMBER = ".3~g"


def model_label(name: str) -> str:
    """``gpt2-xl`` -> "GPT-2 XL", ``bert-96`` -> "BERT-96", ``gpt2-xl-24L`` ->
    "GPT-2 XL, 24 blocks"; a name it does not know comes back as it is."""
    depth = re.fullmatch(r"(.+)-(\d+)L", name)
    if depth:
        return f"{model_label(depth.group(1))}, {depth.group(2)} blocks"
    family, _, rest = name.partition("-")
    key = next((k for k in _FAMILIES if family.startswith(k)), None)
    if key is None:
        return name
    number = family[len(key) :]
    words = _FAMILIES[key] + (f"-{number}" if number else "")
    size = _SIZES.get(rest) or (rest.upper() if re.fullmatch(r"\d+b", rest) else None)
    if not rest:
        return words
    if size is None:
        return f"{words}-{rest}"
    return f"{words}-{size}" if key == "bert" else f"{words} {size}"


def case_label(model: str, minibatch) -> str:
    """One case of a grid: "GPT-2 XL, minibatch 16"."""
    return f"{model_label(model)}, minibatch {int(minibatch)}"


def title(column: str) -> str:
    """The title of ``column`` in axes, legends and tooltips (:data:`TITLES`, else its
    name in words: ``limited_by`` -> "limited by")."""
    return TITLES.get(column, column.replace("_", " "))


def tooltips(df: pd.DataFrame, columns: Iterable[str] | None = None, formats=None) -> list:
    """Altair tooltips for ``columns`` of ``df`` (default: all): each titled in
    words, numbers to three significant digits (``formats``: column -> d3 format)."""
    import altair as alt

    formats = formats or {}
    out = []
    for column in df.columns if columns is None else columns:
        kind = df[column].dtype.kind
        if kind in "fc" or (kind in "iu" and column in formats):
            out.append(
                alt.Tooltip(f"{column}:Q", title=title(column), format=formats.get(column, NUMBER))
            )
        elif kind in "iu":
            out.append(alt.Tooltip(f"{column}:Q", title=title(column), format="d"))
        else:
            out.append(alt.Tooltip(f"{column}:N", title=title(column)))
    return out


#: SI prefixes of d3's "s" format, by power of a thousand
_SI = {-4: "p", -3: "n", -2: "µ", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T", 5: "P"}


#: what Python writes for numbers that are not: a tooltip says "–"
_MISSING = {"nan", "inf", "-inf"}


def formatted_column(values: list, fmt: str | None) -> list[str]:
    """``values`` as d3's format ``fmt`` writes them, for the formats the tooltips
    use: ``d`` (an integer), ``.Nf`` / ``.N~f`` (N decimals; ``~``: no trailing
    zeros), ``.N~g`` (N significant digits) and ``.N~s`` (N significant digits and
    an SI prefix: 12345678 -> "12.3M"); None: each value as text. A missing number
    is "–". A column at a time: a timeline's tooltips are ten thousand numbers."""
    if fmt is None:
        return ["" if v is None else str(v) for v in values]
    spec = re.fullmatch(r"\.?(\d*)(~?)([dfgs])", fmt)
    if spec is None:
        raise ValueError(f"format {fmt!r} is not one of d, .Nf, .N~f, .N~g, .N~s")
    digits, trim, kind = int(spec[1] or 6), spec[2] == "~", spec[3]
    if kind == "s":  # sizes repeat (a layer's bytes): each distinct one written once
        seen: dict = {}
        texts = [seen[v] if v in seen else seen.setdefault(v, _si(v, digits)) for v in values]
    else:
        python = ".0f" if kind == "d" else f".{digits}{kind}"
        texts = [format(v, python) for v in values]
        if kind == "f" and trim:
            texts = [t.rstrip("0").rstrip(".") if "." in t else t for t in texts]
    return [("–" if t in _MISSING else t) for t in texts]


def _si(value: float, digits: int) -> str:
    if not math.isfinite(value):
        return "nan"
    power = 0 if value == 0 else max(-4, min(5, math.floor(math.log10(abs(value)) / 3)))
    text = f"{value / 1000**power:.{digits}g}"
    if "e" in text:  # rounded up to the next prefix (999.9k -> 1e+03k)
        power, text = power + 1, f"{value / 1000 ** (power + 1):.{digits}g}"
    return text + _SI[power]


def _text_column(column: str, fmt: str | None, drawn: Iterable[str]) -> str:
    return column + "_text" if fmt is not None and column in drawn else column


def text_tooltip(fields, drawn: Iterable[str] = ()) -> list[dict]:
    """The Vega-Lite tooltip of the text :func:`tooltip_texts` writes with the same
    ``fields`` and ``drawn``: each shown as it is."""
    return [
        {"field": _text_column(column, fmt, drawn), "type": "nominal", "title": title}
        for column, title, fmt in fields
    ]


def formatted_tooltip(fields) -> list[dict]:
    """The Vega-Lite tooltip of ``fields`` ((column, title, d3 format or None) each),
    its numbers formatted by vega."""
    return [
        {"field": column, "type": "nominal", "title": title}
        if fmt is None
        else {"field": column, "type": "quantitative", "title": title, "format": fmt}
        for column, title, fmt in fields
    ]


def tooltip_texts(df: pd.DataFrame, fields, drawn: Iterable[str] = ()) -> pd.DataFrame:
    """``df`` with the numbers its tooltip shows written as text. ``fields``:
    (column, title, d3 format or None) each; a column with a format is replaced by
    its text (:func:`formatted_column`), or, when it is ``drawn`` (a position the chart
    needs as a number), joined by ``<column>_text``. Written once here, a tooltip is
    text vega shows as it is: a tooltip that formats its numbers makes vega run a
    formatter per field for every mark on every redraw (about a third of drawing
    the explorer's 2,000-bar timeline)."""
    return df.assign(
        **{
            _text_column(column, fmt, drawn): formatted_column(df[column].tolist(), fmt)
            for column, _, fmt in fields
            if fmt is not None
        }
    )


def spans(text: str) -> str:
    """Python's half-open ``(a, b)`` ranges in ``text`` written as a reader does: "a..b-1"."""
    return re.sub(r"\((\d+), (\d+)\)", lambda m: f"{m[1]}..{int(m[2]) - 1}", text)


def layer_range(layers) -> str:
    """A pack's layers as a reader writes them: ``(0, 4)`` -> "layers 0–3"."""
    if isinstance(layers, Sequence) and len(layers) == 2 and not isinstance(layers, str):
        first, end = int(layers[0]), int(layers[1])
        return f"layer {first}" if end - first == 1 else f"layers {first}–{end - 1}"
    return (
        "" if layers is None or (isinstance(layers, float) and layers != layers) else str(layers)
    )


def table(df: pd.DataFrame, digits: int = 3):
    """``df`` for a notebook: numbers to ``digits`` significant digits, every cell on
    one line (long plan strings do not wrap), scrolling sideways when wide."""

    def fmt(v):
        return f"{v:.{digits}g}" if isinstance(v, float) and v == v else v

    floats = [c for c in df.columns if df[c].dtype.kind == "f"]
    return (
        df.style.format(fmt, subset=floats, na_rep="–")
        .set_table_styles([{"selector": "td, th", "props": [("white-space", "nowrap")]}])
        .hide(axis="index")
    )
