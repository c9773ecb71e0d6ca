"""Writing an experiment's results: ``results.json``, CSV tables, SVG + PNG charts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from ...plan import Plan
from ..charts import save


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, pd.DataFrame):
        return _jsonable(value.to_dict(orient="records"))
    if isinstance(value, Plan):
        return value.to_dict()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def write_outputs(
    out_dir: str | Path,
    results: dict[str, Any],
    tables: dict[str, pd.DataFrame] | None = None,
    charts: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``results.json``, each table as ``<name>.csv`` and each chart as
    ``<name>.svg`` and ``<name>.png`` into ``out_dir``; return the paths.
    By convention the main table is ``data`` and the main chart ``figure``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json"]
    paths[0].write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    for name, df in (tables or {}).items():
        path = out / f"{name}.csv"
        df.to_csv(path, index=False)
        paths.append(path)
    for name, chart in (charts or {}).items():
        paths += save(chart, out / name)
    return paths
