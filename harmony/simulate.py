"""A discrete-event player for task graphs.

Lanes run one task at a time: compute lanes in order, transfer and CPU lanes
the ready task with the smallest ``seq`` (see :mod:`harmony.graph`); a task
starts when its lane is free and its dependencies have ended. Compute tasks take their duration.
Transfers share links: at every moment the active transfers get max-min fair
rates over the links of their routes (a GPU's own link and its switch's
uplink are both limits; a byte may take more or less than one unit of a
link, as on a disk whose reads and writes share its time), capped by any
per-transfer rate. Memory is a ledger
per device: buffers are charged when the task that allocates them starts and
freed when their last user ends; the peak is reported (the planner rejects
plans whose peak exceeds capacity).

A copy waits for room: a transfer that would take its device past capacity
(the next pack's weights while the previous pack's gradient is still leaving,
say) does not start until enough has been freed, and its lane starts nothing
else meanwhile (what it holds back is the most urgent). Only when nothing at
all is running, so nothing will be freed, does the most urgent such copy start
anyway, and the peak then exceeds capacity. A graph whose play never has to
wait is played exactly as without the rule.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from .errors import DeadlockError
from .graph import TaskGraph
from .trace import Trace

_EPS = 1e-12


def fair_rates(
    active: dict[int, tuple[tuple[str, ...], float, tuple[float, ...]]],
    capacity: dict[str, float],
) -> dict[int, float]:
    """Max-min fair rates (progressive filling) of transfers over shared links.

    ``active`` maps a transfer to (its links, its own rate cap, per link the
    capacity one byte takes: :meth:`~harmony.graph.Task.link_costs`). Rates rise
    together; a link is full when the sum over its transfers of rate x cost
    reaches its capacity, and its transfers then stop rising (weighted
    progressive filling: with every cost 1, the usual max-min fair shares)."""
    if len(active) == 1:  # the common case: one transfer gets its narrowest link
        ((tid, (links, mx, costs)),) = active.items()
        return {tid: min([mx] + [capacity[link] / c for link, c in zip(links, costs)])}
    rates: dict[int, float] = {}
    left = dict(active)
    cap = dict(capacity)
    users: dict[str, dict[int, float]] = defaultdict(dict)  # link -> {transfer: cost}
    for tid, (links, _, costs) in left.items():
        for link, c in zip(links, costs):
            users[link][tid] = c
    while left:
        share, bottleneck = math.inf, None
        for link, us in users.items():
            if us:
                s = cap[link] / sum(us.values())
                if s < share:
                    share, bottleneck = s, link
        capped = [tid for tid, (_, mx, _) in left.items() if mx <= share]
        frozen = capped if capped else list(users[bottleneck]) if bottleneck else list(left)
        for tid in frozen:
            links, mx, costs = left.pop(tid)
            r = min(mx, share)
            rates[tid] = r
            for link, c in zip(links, costs):
                cap[link] = max(0.0, cap[link] - r * c)
                users[link].pop(tid, None)
    return rates


@dataclass
class Played:
    """One play of a graph: start and end time of every task, peak bytes per
    device, the memory in use over time per device (steps), and the *memory
    order*: per device, the buffers in the order they were allocated and freed,
    as ``(buffer, allocated)`` pairs; the engine admits buffers in this order
    (:mod:`harmony.engine.admission`)."""

    start: list[float]
    end: list[float]
    peak: dict[str, float]
    memory: dict[str, list[tuple[float, float]]]
    order: dict[str, list[tuple[int, bool]]]

    def __iter__(self):  # start, end, peak, memory = play(graph)
        return iter((self.start, self.end, self.peak, self.memory))


def play(graph: TaskGraph) -> Played:
    """Play ``graph``: when each task starts and ends and what memory it takes."""
    return _Player(graph).run()


def _copy_room(graph: TaskGraph) -> dict[int, dict[str, float]]:
    """Per copy that allocates on a device with a capacity, the bytes it allocates there."""
    capacity = graph.memory_capacity
    room: dict[int, dict[str, float]] = {}
    for t in graph.tasks:
        if t.is_transfer:
            for b in t.allocs:
                buf = graph.buffers[b]
                if buf.device in capacity and buf.nbytes > 0:
                    need = room.setdefault(t.id, {})
                    need[buf.device] = need.get(buf.device, 0.0) + buf.nbytes
    return room


def _urgency(ready: dict[str, list], lanes: dict, head: dict[str, int], tasks: list):
    """The key that orders lanes: the seq of the task a lane would start next (lanes
    that may start something go most urgent first, so the most urgent copy gets room
    first). A closure over the player's queues, as fast as the loop needs."""

    def urgency(lane: str) -> tuple:
        if lane in ready:
            return ready[lane][0][0] if ready[lane] else (math.inf,)
        ids, at = lanes[lane], head[lane]
        return tasks[ids[at]].seq if at < len(ids) else (math.inf,)

    return urgency


class _Player:
    """The state of one :func:`play`: the lanes' queues, the memory ledger, what
    computes and what moves, and the clock."""

    def __init__(self, graph: TaskGraph) -> None:
        self.graph = graph
        tasks = self.tasks = graph.tasks
        n = self.n = len(tasks)
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        self.waiting = [len(t.deps) for t in tasks]
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for t in tasks:
            for d in t.deps:
                self.dependents[d].append(t.id)
        lanes = self.lanes = graph.lanes()
        self.lane_of = {i: lane for lane, ids in lanes.items() for i in ids}
        in_order = graph.in_order_lanes()
        self.head = {lane: 0 for lane in lanes}  # next task of an in-order lane
        # heaps of (seq, task)
        self.ready: dict[str, list] = {lane: [] for lane in lanes if lane not in in_order}
        for lane, heap in self.ready.items():
            for i in lanes[lane]:
                if not self.waiting[i]:
                    heap.append((tasks[i].seq, i))
            heapq.heapify(heap)
        self.busy = {lane: False for lane in lanes}
        self.refs = [b.refs for b in graph.buffers]
        self.costs = [t.link_costs() for t in tasks]
        self.capacity = graph.memory_capacity
        # what each copy allocates on a device with a capacity, and the lanes whose most
        # urgent ready copy waits for room on a device
        self.room = _copy_room(graph)
        self.waits_on: dict[str, set[str]] = defaultdict(set)
        self.in_use: dict[str, float] = defaultdict(float)
        self.peak: dict[str, float] = {d: 0.0 for d in graph.memory_capacity}
        self.memory: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.order: dict[str, list[tuple[int, bool]]] = defaultdict(list)
        self.computing: list[tuple[float, int]] = []  # (end time, task)
        self.moving: dict[int, float] = {}  # transfer -> bytes left
        self.rates: dict[int, float] = {}
        self.now, self.done = 0.0, 0
        self.to_check = set(lanes)
        self.rates_stale = False
        self.urgency = _urgency(self.ready, lanes, self.head, tasks)

    def run(self) -> Played:
        while self.done < self.n:
            self.start_what_can()
            if self.done == self.n:
                break
            if not self.start_held_back():
                self.advance()
        return Played(self.start, self.end, self.peak, dict(self.memory), dict(self.order))

    def charge(self, device: str, delta: float) -> None:
        in_use, peak = self.in_use, self.peak
        used = in_use[device] = in_use[device] + delta
        self.memory[device].append((self.now, used))
        if used > peak.get(device, 0.0):
            peak[device] = used

    def fits(self, tid: int) -> str | None:
        """None, or a device that has no room yet for what copy ``tid`` allocates."""
        need = self.room.get(tid)
        if not need:
            return None
        in_use, capacity = self.in_use, self.capacity
        for device, nbytes in need.items():
            if in_use[device] + nbytes > capacity[device] * (1 + 1e-12):
                return device
        return None

    def begin(self, lane: str, tid: int) -> None:
        self.busy[lane] = True
        now = self.now
        self.start[tid] = now
        t = self.tasks[tid]
        if t.allocs:
            buffers, order, charge = self.graph.buffers, self.order, self.charge
            for b in t.allocs:
                buf = buffers[b]
                charge(buf.device, buf.nbytes)
                order[buf.device].append((b, True))
        if t.is_transfer:
            if t.nbytes > 0:
                self.moving[tid] = t.nbytes
                self.rates_stale = True
            else:
                self.finish(tid)
        elif t.duration > 0:
            heapq.heappush(self.computing, (now + t.duration, tid))
        else:
            self.finish(tid)

    def finish(self, tid: int) -> None:
        self.end[tid] = self.now
        self.done += 1
        tasks, to_check = self.tasks, self.to_check
        t = tasks[tid]
        if t.releases:
            refs, buffers = self.refs, self.graph.buffers
            for b in t.releases:
                refs[b] -= 1
                if refs[b] == 0:
                    buf = buffers[b]
                    self.charge(buf.device, -buf.nbytes)
                    self.order[buf.device].append((b, False))
                    to_check.update(self.waits_on.pop(buf.device, ()))
        lane_of = self.lane_of
        lane = lane_of[tid]
        self.busy[lane] = False
        to_check.add(lane)
        waiting, ready = self.waiting, self.ready
        for d in self.dependents[tid]:
            waiting[d] -= 1
            if waiting[d] == 0:
                dl = lane_of[d]
                to_check.add(dl)
                if dl in ready:
                    heapq.heappush(ready[dl], (tasks[d].seq, d))

    def start_what_can(self) -> None:
        """Start what can start now, the most urgent lane first."""
        to_check, busy, ready, head, urgency = (
            self.to_check,
            self.busy,
            self.ready,
            self.head,
            self.urgency,
        )
        lanes, waiting, waits_on, fits, begin = (
            self.lanes,
            self.waiting,
            self.waits_on,
            self.fits,
            self.begin,
        )
        while to_check:
            if len(to_check) == 1:
                lane = to_check.pop()
            else:
                lane = min(to_check, key=lambda x: (urgency(x), x))
                to_check.discard(lane)
            if busy[lane]:
                continue
            if lane in ready:
                if not ready[lane]:
                    continue
                full = fits(ready[lane][0][1])
                if full is not None:
                    waits_on[full].add(lane)
                    continue
                tid = heapq.heappop(ready[lane])[1]
            else:
                ids = lanes[lane]
                if head[lane] >= len(ids) or waiting[ids[head[lane]]]:
                    continue
                tid = ids[head[lane]]
                head[lane] += 1
            begin(lane, tid)

    def start_held_back(self) -> bool:
        """Where nothing runs, so nothing will be freed, the most urgent copy waiting
        for room starts anyway; whether one did."""
        ready = self.ready
        held_back = [lane for lanes_ in self.waits_on.values() for lane in lanes_ if ready[lane]]
        if self.computing or self.moving or not held_back:
            return False
        lane = min(held_back, key=lambda x: ready[x][0])
        self.waits_on.clear()
        self.begin(lane, heapq.heappop(ready[lane])[1])
        self.to_check.update(held_back)
        return True

    def advance(self) -> None:
        """Advance the clock to the next end, and finish what ends then."""
        tasks, moving, computing = self.tasks, self.moving, self.computing
        if self.rates_stale:
            self.rates = fair_rates(
                {tid: (tasks[tid].links, tasks[tid].max_rate, self.costs[tid]) for tid in moving},
                self.graph.links,
            )
            self.rates_stale = False
        rates, now = self.rates, self.now
        t_next = computing[0][0] if computing else math.inf
        finish_at = {tid: now + left / rates[tid] for tid, left in moving.items()}
        if finish_at:
            t_next = min(t_next, min(finish_at.values()))
        if t_next == math.inf:
            raise _deadlock(self.graph, self.start, self.end)
        dt = t_next - now
        self.now = now = t_next
        ended = []
        for tid, at in finish_at.items():
            # ends by its finish time, not by bytes left: `now + tiny` can round to `now`
            if at <= now * (1 + 1e-12) + _EPS:
                del moving[tid]
                ended.append(tid)
                self.rates_stale = True
            else:
                moving[tid] -= rates[tid] * dt
        while computing and computing[0][0] <= now + _EPS:
            ended.append(heapq.heappop(computing)[1])
        for tid in ended:
            self.finish(tid)


def _deadlock(graph: TaskGraph, start: list[float], end: list[float]) -> DeadlockError:
    stuck = []
    for t in graph.tasks:
        if math.isnan(start[t.id]):
            missing = [d for d in t.deps if math.isnan(end[d])]
            if all(not math.isnan(start[d]) or d in missing for d in t.deps):
                stuck.append(
                    f"{t.lane}: task {t.id} {t.kind} '{t.what}' waits on tasks {missing[:5]}"
                )
    return DeadlockError(
        f"task graph deadlocks: {sum(math.isnan(x) for x in start)} tasks never start; "
        "some waiting tasks:\n  " + "\n  ".join(stuck[:12])
    )


def simulate_graph(graph: TaskGraph) -> Trace:
    played = play(graph)
    return Trace.from_run(
        graph,
        played.start,
        played.end,
        [t.nbytes for t in graph.tasks],
        played.peak,
        played.memory,
    )
