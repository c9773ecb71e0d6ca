"""Per-layer profiles measured by the Harmony authors on GTX 1080 Ti GPUs.

The CSV files in ``harmony/data/reference/harmony-1080ti`` (with their README:
provenance, MIT license of the source repository, caveats) are loaded into a
:class:`~harmony.costs.spec.ModelSpec` with measured time and memory curves.

Memory: the profiler's per-layer peak covers the layer's weights (and for
backward, their gradients) and its input; the spec keeps only what comes on
top (``fwd_extra`` / ``bwd_extra``), since the simulator charges weights,
gradients and inputs as buffers of their own.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pandas as pd

from ..errors import HarmonyError
from .spec import Curve, LayerCost, ModelSpec

REFERENCE_DIR = Path(__file__).parent / "data" / "reference" / "harmony-1080ti"

#: model name -> reference variant (file prefix)
VARIANTS = {
    "bert-large": "bert_large_seqlen512",
    "bert-large-128": "bert_large_seqlen128",
    "bert-96": "bert_96_seqlen512",
    "gpt2-medium": "gpt2_medium",
    "gpt2-xl": "gpt2_xl",
    "gpt2-b-1layer": "gpt2_b_1layer",
    "gpt2-10b": "gpt2_10b",
    "gpt2-20b": "gpt2_20b",
    "gpt2-30b": "gpt2_30b",
    "gpt2-40b": "gpt2_40b",
    "vgg416": "vgg416",
    "resnet1026": "resnet1026",
}

#: optimizers the authors profiled with (see the reference README)
_OPTIMIZER = {"bert": "adam", "gpt2": "adamw", "vgg": "sgd-momentum", "resnet": "sgd-momentum"}

_DESC = re.compile(r"(\w+):(\w+)\[([^\]]*)\]")
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def _split_input(desc: str) -> tuple[float, float]:
    """(float elements, non-float bytes) per sample from e.g.
    ``"input0:int64[u,512]; input2:float32[u,1,1,512]"``."""
    floats, fixed = 0.0, 0.0
    for _, dtype, shape in _DESC.findall(desc or ""):
        numel = 1
        for dim in shape.split(","):
            dim = dim.strip()
            if dim and dim != "u":
                numel *= int(dim)
        if dtype.startswith("float"):
            floats += numel
        else:
            fixed += numel * _ELEMENT_BYTES[dtype]
    return floats, fixed


@lru_cache(maxsize=None)
def load(name: str) -> ModelSpec:
    """The reference profile of ``name`` (a key of :data:`VARIANTS`) as a ModelSpec."""
    variant = VARIANTS.get(name, name if name in VARIANTS.values() else None)
    if variant is None:
        raise HarmonyError(
            f"no reference profile for {name!r}; profiled models: {', '.join(VARIANTS)}"
        )
    layers_csv = REFERENCE_DIR / f"{variant}.layers.csv"
    times_csv = REFERENCE_DIR / f"{variant}.times.csv"
    if not times_csv.exists():
        raise HarmonyError(
            f"reference variant {variant!r} has no measured times (layers file only)"
        )
    meta = pd.read_csv(layers_csv)
    times = pd.read_csv(times_csv)
    curves = {
        (int(layer), phase): (
            g["ubatch_size"].to_numpy(),
            g["time_s"].to_numpy(),
            g["peak_memory_bytes"].to_numpy(),
        )
        for (layer, phase), g in times.sort_values("ubatch_size").groupby(["layer", "phase"])
    }
    layers = []
    for row in meta.itertuples(index=False):
        floats, fixed = _split_input(row.input_desc)
        x_per_sample = floats * 4 + fixed
        if abs(x_per_sample - row.input_bytes_per_sample) > 0.5:
            raise HarmonyError(
                f"{variant} layer {row.layer}: input_desc disagrees with input_bytes_per_sample"
            )
        w = float(row.param_bytes) + float(row.buffer_bytes)
        us_f, t_f, m_f = curves[(row.layer, "FWD")]
        us_b, t_b, m_b = curves[(row.layer, "BWD")]
        target = (
            0.0 if pd.isna(row.target_bytes_per_sample) else float(row.target_bytes_per_sample)
        )
        layers.append(
            LayerCost(
                name=f"{row.layer}:{row.name}",
                param_numel=int(row.param_count),
                buffer_numel=int(row.buffer_bytes) // 4,
                input_numel_per_sample=floats,
                input_fixed_bytes_per_sample=fixed,
                fwd_time=Curve.table(us_f, t_f),
                bwd_time=Curve.table(us_b, t_b),
                # what the peak holds beyond weights (+ gradients), the input (+ labels)
                fwd_extra=Curve.table(
                    us_f,
                    [max(0.0, m - w - u * (x_per_sample + target)) for u, m in zip(us_f, m_f)],
                ),
                bwd_extra=Curve.table(
                    us_b,
                    [max(0.0, m - 2 * w - u * (x_per_sample + target)) for u, m in zip(us_b, m_b)],
                ),
                update_time_s=float(row.update_time_s),
            )
        )
    target = meta["target_bytes_per_sample"].dropna()
    family = next(k for k in _OPTIMIZER if variant.startswith(k))
    return ModelSpec(
        name=name if name in VARIANTS else variant,
        layers=tuple(layers),
        optimizer=_OPTIMIZER[family],
        target_bytes_per_sample=float(target.iloc[-1]) if len(target) else 0.0,
        source=f"reference:{variant} (GTX 1080 Ti, measured by the Harmony authors)",
    )


def max_profiled(spec: ModelSpec) -> tuple[int | None, int | None]:
    """Largest microbatch sizes measured forward and backward (None: analytic)."""
    f = [
        c.fwd_time.max_measured_u
        for c in spec.layers
        if c.fwd_time is not None and c.fwd_time.measured
    ]
    b = [
        c.bwd_time.max_measured_u
        for c in spec.layers
        if c.bwd_time is not None and c.bwd_time.measured
    ]
    return (min(f) if f else None, min(b) if b else None)
