"""Play a TaskGraph for real: one thread per lane.

The same rules as the simulator (:mod:`harmony.graph`): a lane runs one task
at a time; compute lanes in ``seq`` order, other lanes the ready task with the
smallest ``seq``; a task starts once its dependencies have ended. What a task
*does* is up to the caller's ``run_task(task)``. The first exception stops
every lane and is raised from :meth:`Executor.run` once all threads are done.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..graph import Task, TaskGraph


class Executor:
    def __init__(self, graph: TaskGraph, run_task: Callable[[Task], None]):
        self.graph = graph
        self.run_task = run_task
        n = len(graph.tasks)
        self.start = [float("nan")] * n
        self.end = [float("nan")] * n
        self._done = [False] * n
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def _ready(self, t: Task) -> bool:
        return all(self._done[d] for d in t.deps)

    def _lane(self, ids: list[int], in_order: bool, t0: float) -> None:
        pending = list(ids)
        while pending:
            with self._cond:
                while True:
                    if self._error is not None:
                        return
                    if in_order:
                        pick = pending[0] if self._ready(self.graph.tasks[pending[0]]) else None
                    else:  # ids are in seq order: the first ready one has the smallest seq
                        pick = next((i for i in pending if self._ready(self.graph.tasks[i])), None)
                    if pick is not None:
                        break
                    self._cond.wait()
            pending.remove(pick)
            task = self.graph.tasks[pick]
            self.start[pick] = time.perf_counter() - t0
            try:
                self.run_task(task)
            except BaseException as e:  # noqa: BLE001 - re-raised from run()
                with self._cond:
                    if self._error is None:
                        self._error = e
                    self._cond.notify_all()
                return
            self.end[pick] = time.perf_counter() - t0
            with self._cond:
                self._done[pick] = True
                self._cond.notify_all()

    def run(self, t0: float | None = None) -> float:
        """Run every task; return the wall time. Raises the first task error.
        Task times are seconds since ``t0`` (default: now).

        The first compute lane runs on the calling thread: torch runs measurably
        slower on a fresh thread (allocator arenas), and the main thread is what a
        plain training loop uses."""
        in_order = self.graph.in_order_lanes()
        lanes = sorted(self.graph.lanes().items(), key=lambda kv: kv[0] not in in_order)
        t0 = time.perf_counter() if t0 is None else t0
        threads = [
            threading.Thread(target=self._lane, args=(ids, lane in in_order, t0), name=f"harmony-{lane}",
                             daemon=True)
            for lane, ids in lanes[1:]
        ]
        for th in threads:
            th.start()
        if lanes:
            lane, ids = lanes[0]
            self._lane(ids, lane in in_order, t0)
        for th in threads:
            th.join()
        if self._error is not None:
            raise self._error
        return time.perf_counter() - t0
