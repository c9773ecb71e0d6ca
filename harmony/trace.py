"""Trace: what happened in one iteration, with one schema for the simulator and
the engine, so a comparison (simulated vs measured, policy vs policy) is one join.

``timeline`` has one row per task: ``device, lane, kind, model, pack,
microbatch, start_s, end_s, bytes`` (plus ``layers`` and ``what`` to read it).
``summary`` is a :class:`Summary`: the iteration time, samples/s, bytes by
kind (host<->GPU swap and host<->disk apart), peak memory per device and the
lower bound (every link, the disk's included, at its bandwidth), and for a step of the
engine what its ledgers and buffer pools saw. Both executors make their
trace with :meth:`Trace.from_run`, from the graph, when each task started and
ended, and the bytes each moved.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from .graph import DISK_IN, DISK_OUT, TRANSFER_KINDS, UPD, TaskGraph

TIMELINE_COLUMNS = [
    "device",
    "lane",
    "kind",
    "model",
    "pack",
    "microbatch",
    "start_s",
    "end_s",
    "bytes",
]
#: transfers between host and GPU memory ("swap"); P2P and REDUCE stay between GPUs
HOST_LINK_KINDS = (
    "W_IN",
    "G_OUT",
    "STASH_OUT",
    "STASH_IN",
    "ACT_OUT",
    "ACT_IN",
    "DATA_IN",
    "G_IN",
    "OPT_IN",
    "OPT_OUT",
)


@dataclass(frozen=True)
class Summary:
    """One iteration in numbers, the same fields whichever executor played it."""

    iteration_s: float
    samples: int
    bytes_by_kind: dict[str, float]
    peak_memory: dict[str, float]  # bytes per device
    memory_capacity: dict[str, float]
    #: the slowest of: each GPU's compute, each link's bytes at full bandwidth (the
    #: disk tier's ``host.disk_read`` / ``host.disk_write`` too), the CPU updates
    #: spread over the workers (``lower_bound_by`` names it)
    lower_bound_s: float
    lower_bound_by: str
    policy: str = ""
    model: str = ""
    hardware: str = ""
    executor: str = "simulator"  # or "engine"
    #: the engine's: bytes a device held beyond what the graph declared (0 when the
    #: spec counts right), the most working memory a compute task was declared but
    #: never held (0 when the spec does not overcount), the peak of its tensors
    #: themselves, and the buffers its pools had to allocate this step (none once a
    #: plan has run a step). The first three are None where a device does not measure
    #: what its tasks hold (the ``cpu`` backend: ``Backend.meters_work``)
    undeclared_bytes: dict[str, float] | None = None
    unheld_work_bytes: dict[str, float] | None = None
    held_peak_memory: dict[str, float] | None = None
    new_buffers: int | None = None
    new_buffer_bytes: int | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_s if self.iteration_s > 0 else math.inf

    @property
    def swap_bytes(self) -> float:
        """Bytes between host and GPU memory."""
        return sum(v for k, v in self.bytes_by_kind.items() if k in HOST_LINK_KINDS)

    @property
    def disk_read_bytes(self) -> float:
        """Bytes read from the disk tier into host memory (DISK_IN)."""
        return self.bytes_by_kind.get(DISK_IN, 0.0)

    @property
    def disk_write_bytes(self) -> float:
        """Bytes written from host memory to the disk tier (DISK_OUT)."""
        return self.bytes_by_kind.get(DISK_OUT, 0.0)

    @property
    def disk_bytes(self) -> float:
        """Bytes between host memory and the disk tier, both ways (not swap)."""
        return self.disk_read_bytes + self.disk_write_bytes

    @property
    def fits(self) -> bool:
        return all(self.peak_memory.get(d, 0.0) <= c for d, c in self.memory_capacity.items())

    @property
    def time_over_lower_bound(self) -> float:
        return self.iteration_s / self.lower_bound_s if self.lower_bound_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Every field and derived number, JSON-ready."""
        return {
            **asdict(self),
            "samples_per_s": self.samples_per_s,
            "swap_bytes": self.swap_bytes,
            "disk_read_bytes": self.disk_read_bytes,
            "disk_write_bytes": self.disk_write_bytes,
            "fits": self.fits,
            "time_over_lower_bound": self.time_over_lower_bound,
        }


@dataclass
class Trace:
    summary: Summary
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
        return self.summary.iteration_s

    @classmethod
    def from_run(
        cls,
        graph: TaskGraph,
        start: Sequence[float],
        end: Sequence[float],
        moved: Sequence[float],
        peak: dict[str, float],
        memory: dict[str, list[tuple[float, float]]],
        *,
        capacity: dict[str, float] | None = None,
        iteration_s: float | None = None,
        link_bounds: bool = True,
        **summary: Any,
    ) -> "Trace":
        """The trace of one play of ``graph``: when each task started and ended
        (seconds), the bytes each moved, the peak and memory-over-time per device.
        ``capacity``: per device (default: the graph's); ``iteration_s``: the
        wall time (default: the last end); ``link_bounds``: whether links limit
        (not on an unpaced backend); ``summary``: further :class:`Summary` fields."""
        compute: dict[str, float] = defaultdict(float)
        link_bytes: dict[str, float] = defaultdict(float)
        by_kind: dict[str, float] = defaultdict(float)
        cpu = 0.0
        for t in graph.tasks:
            i, kind = t.id, t.kind
            if kind == UPD:
                cpu += end[i] - start[i]
            elif kind in TRANSFER_KINDS:
                by_kind[kind] += moved[i]
                if t.costs:
                    for link, cost in zip(t.links, t.costs):
                        link_bytes[link] += moved[i] * cost
                else:  # a cost of 1 on each link (Task.link_costs)
                    for link in t.links:
                        link_bytes[link] += moved[i] * 1.0
            else:
                compute[t.device] += end[i] - start[i]
        bounds = {f"compute:{d}": v for d, v in compute.items()}
        bounds["cpu_update"] = cpu / max(1, graph.cpu_workers)
        if link_bounds:
            bounds.update({f"link:{k}": v / graph.links[k] for k, v in link_bytes.items()})
        lower, limiter = max(((v, k) for k, v in bounds.items()), default=(0.0, ""))
        info = {k: graph.info[k] for k in ("policy", "model", "hardware") if k in graph.info}
        result = Summary(
            iteration_s=max(end, default=0.0) if iteration_s is None else iteration_s,
            samples=graph.samples,
            bytes_by_kind=dict(by_kind),
            peak_memory=dict(peak),
            memory_capacity=dict(graph.memory_capacity if capacity is None else capacity),
            lower_bound_s=lower,
            lower_bound_by=limiter,
            **{**info, **summary},
        )
        start, end, moved = list(start), list(end), list(moved)

        def rows() -> list[dict[str, Any]]:
            return [
                {
                    "device": t.device,
                    "lane": t.lane,
                    "kind": t.kind,
                    "model": t.model,
                    "pack": t.pack,
                    "microbatch": t.microbatch,
                    "start_s": start[t.id],
                    "end_s": end[t.id],
                    "bytes": moved[t.id],
                    "layers": t.layers,
                    "what": t.what,
                }
                for t in graph.tasks
            ]

        return cls(result, memory, rows)

    def memory_timeline(self) -> pd.DataFrame:
        """Bytes in use per device over time (one row per change)."""
        return pd.DataFrame(
            [
                {"device": d, "time_s": t, "bytes": b}
                for d, steps in self.memory.items()
                for t, b in steps
            ],
            columns=["device", "time_s", "bytes"],
        )

    def to_chrome(self, path: str | Path) -> Path:
        """Write a Chrome trace (open it in Perfetto or chrome://tracing)."""
        events = []
        for r in self.rows:
            if math.isnan(r["start_s"]):
                continue
            events.append(
                {
                    "name": r["kind"] if not r.get("what") else f"{r['kind']} {r['what']}",
                    "cat": r["kind"],
                    "ph": "X",
                    "pid": r["device"],
                    "tid": r["lane"],
                    "ts": r["start_s"] * 1e6,
                    "dur": max(0.0, (r["end_s"] - r["start_s"]) * 1e6),
                    "args": {
                        "bytes": r["bytes"],
                        "pack": r["pack"],
                        "microbatch": r["microbatch"],
                        "model": r["model"],
                    },
                }
            )
        path = Path(path)
        path.write_text(
            json.dumps(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ms",
                    "otherData": {k: str(v) for k, v in self.summary.to_dict().items()},
                }
            )
        )
        return path
