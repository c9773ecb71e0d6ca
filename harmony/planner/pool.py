"""Simulating the search's candidates: each plan's graph built and played, in
worker processes or inline."""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

from ..costs.hardware import Hardware
from ..costs.placement import HostMemoryError
from ..costs.spec import ModelSpec
from ..plan import Plan
from ..policies import build_graph
from ..simulate import gc_paused, simulate_graph
from ..trace import Summary


def _summary(spec: ModelSpec, hw: Hardware, plan: Plan) -> Summary | HostMemoryError:
    """The plan's simulated summary, or why its state does not fit the host."""
    with gc_paused():
        try:
            graph = build_graph(spec, hw, plan)
        except HostMemoryError as e:
            return e
        summary = simulate_graph(graph).summary
        # freed while the collector is still paused: alive when it resumes, the graph's
        # tens of thousands of objects would make its first round walk them all
        del graph
    return summary


_WORKER_ARGS: tuple | None = None


def _init_worker(spec: ModelSpec, hw: Hardware) -> None:
    global _WORKER_ARGS
    _WORKER_ARGS = (spec, hw)


def _work(plan: Plan) -> Summary | HostMemoryError:
    return _summary(*_WORKER_ARGS, plan)


class Pool:
    """Simulate plans in worker processes (forked: the simulator is pure Python,
    no torch state crosses the fork) or inline when one worker is asked for."""

    def __init__(self, spec: ModelSpec, hw: Hardware, workers: int | None):
        self.spec, self.hw = spec, hw
        if workers is None:
            workers = min(4, os.cpu_count() or 1)
        self.executor = None
        self.workers = 1
        if workers > 1 and "fork" in mp.get_all_start_methods():
            self.executor = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("fork"),
                initializer=_init_worker,
                initargs=(spec, hw),
            )
            self.workers = workers

    def map(self, plans: list[Plan]) -> list[Summary | HostMemoryError]:
        if self.executor is None or len(plans) < 2:
            return [_summary(self.spec, self.hw, p) for p in plans]
        return list(self.executor.map(_work, plans, chunksize=max(1, len(plans) // 16)))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
