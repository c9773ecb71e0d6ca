"""Device memory taken and given back in the order the simulator played it.

The simulator charges a buffer when the task that makes it starts and frees it
when the last task that reads it ends; the sequence of these events on each
device is the plan's *memory order* (:class:`harmony.simulate.Played`). The
engine keeps it: a task that makes buffers on a device may start only once
every earlier event of that device has happened (in particular the frees
before it: every task that reads those buffers has ended), and frees are
counted in the same order. Each device's ledger then goes through exactly the
simulator's sequence of amounts, so the engine's peak is the simulated one
whatever the timing of its lanes, and a plan that fits in the simulator never
runs out of memory in the engine.

The order comes from a real play of the graph, in which every task's
dependencies, its lane's earlier tasks and the events before its own ended
first; so an executor whose lanes take the first *admissible* ready task can
always make progress (the task that started earliest in the play among those
not yet started is admissible once its predecessors are done). A copy that
waited in the play for room on a full device (see :mod:`harmony.simulate`)
waits here the same way: its allocation comes after the frees that made room.
"""

from __future__ import annotations

from collections import defaultdict

from ..graph import TaskGraph


class MemoryOrder:
    """Admits one graph's buffers on each device in a given order, charging the
    declared bytes to the device's ledger (``ledgers[device].charge/release``).
    Not thread-safe by itself: the executor calls it under its own lock."""

    def __init__(self, graph: TaskGraph, order: dict[str, list[tuple[int, bool]]], ledgers: dict):
        self.graph, self.ledgers = graph, ledgers
        self.events = {d: list(events) for d, events in order.items() if d in ledgers}
        self.position = {d: 0 for d in self.events}
        # task -> {device: index of its allocation event}; the first buffer it makes
        # there marks its place, the others follow at once
        self.places: dict[int, dict[str, int]] = defaultdict(dict)
        owner = {}
        for t in graph.tasks:
            for b in t.allocs:
                owner[b] = t.id
        for d, events in self.events.items():
            for i, (b, allocated) in enumerate(events):
                if allocated:
                    self.places[owner[b]].setdefault(d, i)
        self.refs = [b.refs for b in graph.buffers]
        self.freed = set()  # buffers whose every reader has ended
        self.held: dict[str, float] = defaultdict(float)  # declared bytes charged now, per device

    def admissible(self, task_id: int) -> bool:
        """Whether every earlier event of each device the task allocates on has happened."""
        return all(self.position[d] == i for d, i in self.places.get(task_id, {}).items())

    def start(self, task_id: int) -> None:
        """Charge the task's buffers (it is admissible). Raises the ledger's
        out-of-memory error if a device's capacity would be exceeded."""
        for d in self.places.get(task_id, {}):
            events = self.events[d]
            while self.position[d] < len(events):
                b, allocated = events[self.position[d]]
                if not allocated or b not in self.graph.tasks[task_id].allocs:
                    break
                buf = self.graph.buffers[b]
                self.ledgers[d].charge(buf.nbytes, buf.what)
                self.held[d] += buf.nbytes
                self.position[d] += 1
            self._advance(d)

    def end(self, task_id: int) -> None:
        """The task ended: buffers it was the last reader of are freed, in order."""
        touched = set()
        for b in self.graph.tasks[task_id].releases:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.freed.add(b)
                touched.add(self.graph.buffers[b].device)
        for d in touched:
            if d in self.events:
                self._advance(d)

    def _advance(self, device: str) -> None:
        events, ledger = self.events[device], self.ledgers[device]
        while self.position[device] < len(events):
            b, allocated = events[self.position[device]]
            if allocated or b not in self.freed:
                return
            n = self.graph.buffers[b].nbytes
            ledger.release(n)
            self.held[device] -= n
            self.position[device] += 1

    def release_all(self) -> None:
        """A failed step: give back every declared byte still charged."""
        for d, n in self.held.items():
            if n:
                self.ledgers[d].release(n)
        self.held.clear()
