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

With a :class:`~harmony.engine.admission.MemoryOrder`, a ready task also waits
for its turn to take device memory: a lane runs the first ready task that is
*admissible*, and memory is charged and given back in the simulator's order.

With ``one_thread``, the calling thread plays every task itself, in ``seq``
order (every dependency has a smaller ``seq``, so the order is one the lanes
could have played) or in the ``order`` given (the caller's: one that respects
every dependency): for devices where no lane's work would overlap another's,
lane threads would only hand each task over through a condition variable and
take the GIL from the compute thread mid-step.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Callable

from ..graph import Task, TaskGraph
from .admission import MemoryOrder


class Executor:
    def __init__(
        self,
        graph: TaskGraph,
        run_task: Callable[[Task], None],
        admission: MemoryOrder | None = None,
        one_thread: bool = False,
        order: list[Task] | None = None,
    ):
        if one_thread and admission is not None:
            raise ValueError(
                "one_thread plays every task on the calling thread, in seq order or the order "
                "given: it cannot wait for a memory order (admission); leave one of them out"
            )
        self.graph = graph
        self.one_thread = one_thread
        self.order = order
        self.run_task = run_task
        self.admission = admission
        n = len(graph.tasks)
        self.start = [float("nan")] * n
        self.end = [float("nan")] * n
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        if not one_thread:
            self._set_up_lanes()

    def _set_up_lanes(self) -> None:
        """Each lane's order, condition and ready heap; each task's unmet dependencies."""
        graph, n = self.graph, len(self.graph.tasks)
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
        admissible = self.admission.admissible if self.admission is not None else None
        if lane in self._in_order:
            if ready[0] != next_position or (admissible and not admissible(ids[ready[0]])):
                return None
            return ids[heapq.heappop(ready)]
        if admissible is None or admissible(ids[ready[0]]):
            return ids[heapq.heappop(ready)]
        # the first ready task that may take its memory now, the others stay ready
        for position in sorted(ready)[1:]:
            if admissible(ids[position]):
                ready.remove(position)
                heapq.heapify(ready)
                return ids[position]
        return None

    def _wake_waiting(self) -> None:
        """Memory moved on: lanes with ready tasks may now admit one (lock held)."""
        for lane, ready in self._ready.items():
            if ready:
                self._wake[lane].notify()

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
                if self.admission is not None:
                    try:
                        self.admission.start(pick)
                    except BaseException as e:  # noqa: BLE001
                        self._fail(e)  # out of memory: re-raised from run()
                        return
                    self._wake_waiting()
            self.start[pick] = time.perf_counter() - t0
            try:
                self.run_task(task)
            except BaseException as e:  # noqa: BLE001 - re-raised from run()
                with self._lock:
                    self._fail(e)
                return
            self.end[pick] = time.perf_counter() - t0
            with self._lock:
                if self.admission is not None:
                    self.admission.end(pick)
                    self._wake_waiting()
                self._finished(pick)

    def _play_in_order(self, t0: float) -> None:
        """Every task on this thread, in ``order`` or ``seq`` order; the first error is raised."""
        run_task, clock = self.run_task, time.perf_counter
        start, end = self.start, self.end
        for task in self.order or sorted(self.graph.tasks, key=lambda t: t.seq):
            start[task.id] = clock() - t0
            run_task(task)
            end[task.id] = clock() - t0

    def _fail(self, error: BaseException) -> None:
        """The first error stops every lane (lock held)."""
        if self._error is None:
            self._error = error
        for cond in self._wake.values():
            cond.notify_all()

    def run(self, t0: float | None = None) -> float:
        """Run every task; return the wall time. Raises the first task error.
        Task times are seconds since ``t0`` (default: now).

        The first compute lane runs on the calling thread: torch runs measurably
        slower on a fresh thread (allocator arenas), and the main thread is what a
        plain training loop uses."""
        t0 = time.perf_counter() if t0 is None else t0
        if self.one_thread:
            self._play_in_order(t0)
            return time.perf_counter() - t0
        lanes = sorted(self._lanes, key=lambda lane: lane not in self._in_order)
        threads = [
            threading.Thread(
                target=self._lane, args=(lane, t0), name=f"harmony-{lane}", daemon=True
            )
            for lane in lanes[1:]
        ]
        for th in threads:
            th.start()
        if lanes:
            self._lane(lanes[0], t0)
        for th in threads:
            th.join()
        if self._error is not None:
            if self.admission is not None:
                self.admission.release_all()
            raise self._error
        return time.perf_counter() - t0
