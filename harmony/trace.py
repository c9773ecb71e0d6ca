"""Trace: what happened in one iteration, with one schema for the simulator and
the engine, so a comparison (simulated vs measured, policy vs policy) is one join.

``timeline`` has one row per task: ``device, lane, kind, model, pack,
microbatch, start_s, end_s, bytes`` (plus ``layers`` and ``what`` to read it).
``summary`` holds the iteration time, samples/s, bytes by kind, peak memory
per device and the lower bound; a step of the engine adds ``new_buffers`` and
``new_buffer_bytes``, what its buffer pools had to allocate (none once a plan
has run a step).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from .graph import TaskGraph

TIMELINE_COLUMNS = ["device", "lane", "kind", "model", "pack", "microbatch", "start_s", "end_s", "bytes"]
#: transfers between host and GPU memory ("swap"); P2P and REDUCE stay between GPUs
HOST_LINK_KINDS = ("W_IN", "G_OUT", "STASH_OUT", "STASH_IN", "ACT_OUT", "ACT_IN", "DATA_IN")


@dataclass
class Trace:
    summary: dict[str, Any]
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    #: one dict per task; built on first use when the trace comes from a graph
    rows_factory: Callable[[], list[dict[str, Any]]] = field(default=list, repr=False)

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        return self.rows_factory()

    @cached_property
    def timeline(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows)
        if df.empty:
            return pd.DataFrame(columns=TIMELINE_COLUMNS)
        rest = [c for c in df.columns if c not in TIMELINE_COLUMNS]
        return df[TIMELINE_COLUMNS + rest]

    @property
    def iteration_s(self) -> float:
        return self.summary["iteration_s"]

    @classmethod
    def from_graph(cls, graph: TaskGraph, start: list[float], end: list[float],
                   peak: dict[str, float], memory: dict[str, list[tuple[float, float]]]) -> "Trace":
        def rows() -> list[dict[str, Any]]:
            return [
                {"device": t.device, "lane": t.lane, "kind": t.kind, "model": t.model, "pack": t.pack,
                 "microbatch": t.microbatch, "start_s": start[t.id], "end_s": end[t.id],
                 "bytes": t.nbytes, "layers": t.layers, "what": t.what}
                for t in graph.tasks
            ]

        iteration = max(end) if end else 0.0
        bounds = graph.lower_bound()
        summary = summarize(iteration, graph.samples, graph.bytes_by_kind(), peak,
                            graph.memory_capacity, bounds)
        summary.update({k: v for k, v in graph.info.items() if k in ("policy", "model", "hardware")})
        return cls(summary, memory, rows)

    def memory_timeline(self) -> pd.DataFrame:
        """Bytes in use per device over time (one row per change)."""
        return pd.DataFrame(
            [{"device": d, "time_s": t, "bytes": b} for d, steps in self.memory.items() for t, b in steps],
            columns=["device", "time_s", "bytes"],
        )

    def to_chrome(self, path: str | Path) -> Path:
        """Write a Chrome trace (open it in Perfetto or chrome://tracing)."""
        events = []
        for r in self.rows:
            if math.isnan(r["start_s"]):
                continue
            events.append({
                "name": r["kind"] if not r.get("what") else f"{r['kind']} {r['what']}",
                "cat": r["kind"], "ph": "X", "pid": r["device"], "tid": r["lane"],
                "ts": r["start_s"] * 1e6, "dur": max(0.0, (r["end_s"] - r["start_s"]) * 1e6),
                "args": {"bytes": r["bytes"], "pack": r["pack"], "microbatch": r["microbatch"],
                         "model": r["model"]},
            })
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                    "otherData": {k: str(v) for k, v in self.summary.items()}}))
        return path


def summarize(iteration_s: float, samples: int, bytes_by_kind: dict[str, float], peak: dict[str, float],
              capacity: dict[str, float], bounds: dict[str, float]) -> dict[str, Any]:
    """The summary both executors report."""
    lower, limiter = max(((v, k) for k, v in bounds.items()), default=(0.0, ""))
    return {
        "iteration_s": iteration_s,
        "samples_per_s": samples / iteration_s if iteration_s > 0 else math.inf,
        "samples": samples,
        "bytes_by_kind": dict(bytes_by_kind),
        "swap_bytes": sum(v for k, v in bytes_by_kind.items() if k in HOST_LINK_KINDS),
        "peak_memory": dict(peak),
        "memory_capacity": dict(capacity),
        "fits": all(peak.get(d, 0.0) <= c for d, c in capacity.items()),
        "lower_bound_s": lower,
        "lower_bound_by": limiter,
        "time_over_lower_bound": iteration_s / lower if lower > 0 else math.nan,
    }
