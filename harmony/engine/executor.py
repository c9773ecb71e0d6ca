"""Play a TaskGraph for real: one thread per lane.

The same rules as the simulator (:mod:`harmony.graph`): a lane runs one task
at a time; compute lanes in ``seq`` order, other lanes the ready task with the
smallest ``seq``; a task starts once its dependencies have ended. What a task
*does* is up to the caller's ``run_task(task)``. The first exception stops
every lane and is raised from :meth:`Executor.run` once all threads are done.

Bookkeeping is per lane, so a task's end wakes only the lanes that have a task
waiting on it (not every lane), and picking the next task costs O(log n): each
task counts its unfinished dependencies, and a lane keeps a heap of its tasks
that are ready.
"""

from __future__ import annotations

import heapq
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
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._lanes = graph.lanes()  # lane -> task ids in the order it runs them
        self._in_order = graph.in_order_lanes()
        self._wake = {lane: threading.Condition(self._lock) for lane in self._lanes}
        self._position = {i: k for ids in self._lanes.values() for k, i in enumerate(ids)}
        self._unmet = [len(t.deps) for t in graph.tasks]
        self._dependents: list[list[int]] = [[] for _ in range(n)]
        for t in graph.tasks:
            for d in t.deps:
                self._dependents[d].append(t.id)
        # per lane: its ready tasks by position (in-order lanes only ever take the head)
        self._ready: dict[str, list[int]] = {lane: [] for lane in self._lanes}
        for t in graph.tasks:
            if not t.deps:
                heapq.heappush(self._ready[t.lane], self._position[t.id])

    def _take(self, lane: str, ids: list[int], next_position: int) -> int | None:
        """The task ``lane`` runs next, if one is ready (called with the lock held)."""
        ready = self._ready[lane]
        if not ready:
            return None
        if lane in self._in_order:
            if ready[0] != next_position:
                return None
        return ids[heapq.heappop(ready)]

    def _finished(self, tid: int) -> None:
        """``tid`` ended: its dependents may now be ready (called with the lock held)."""
        woken = set()
        for d in self._dependents[tid]:
            self._unmet[d] -= 1
            if self._unmet[d] == 0:
                lane = self.graph.tasks[d].lane
                heapq.heappush(self._ready[lane], self._position[d])
                woken.add(lane)
        for lane in woken:
            self._wake[lane].notify()

    def _lane(self, lane: str, t0: float) -> None:
        ids = self._lanes[lane]
        for done in range(len(ids)):
            with self._lock:
                while True:
                    if self._error is not None:
                        return
                    pick = self._take(lane, ids, done)
                    if pick is not None:
                        break
                    self._wake[lane].wait()
            task = self.graph.tasks[pick]
            self.start[pick] = time.perf_counter() - t0
            try:
                self.run_task(task)
            except BaseException as e:  # noqa: BLE001 - re-raised from run()
                with self._lock:
                    if self._error is None:
                        self._error = e
                    for cond in self._wake.values():
                        cond.notify_all()
                return
            self.end[pick] = time.perf_counter() - t0
            with self._lock:
                self._finished(pick)

    def run(self, t0: float | None = None) -> float:
        """Run every task; return the wall time. Raises the first task error.
        Task times are seconds since ``t0`` (default: now).

        The first compute lane runs on the calling thread: torch runs measurably
        slower on a fresh thread (allocator arenas), and the main thread is what a
        plain training loop uses."""
        lanes = sorted(self._lanes, key=lambda lane: lane not in self._in_order)
        t0 = time.perf_counter() if t0 is None else t0
        threads = [threading.Thread(target=self._lane, args=(lane, t0), name=f"harmony-{lane}", daemon=True)
                   for lane in lanes[1:]]
        for th in threads:
            th.start()
        if lanes:
            self._lane(lanes[0], t0)
        for th in threads:
            th.join()
        if self._error is not None:
            raise self._error
        return time.perf_counter() - t0
