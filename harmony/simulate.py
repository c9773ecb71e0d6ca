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
from .gc_pause import gc_paused
from .graph import TaskGraph
from .play_tables import COMPUTES, MOVES, Tables
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
    with gc_paused():
        return _Player(graph).run()


_NEVER = (math.inf,)  # the urgency of a lane with nothing to start


class _Player:
    """The state of one :func:`play`: the lanes' queues, the memory ledger, what
    computes and what moves, and the clock. Lanes, devices and routes are numbers
    (:class:`~harmony.play_tables.Tables`); a lane's urgency (the seq of the task it
    would start next, then its number: lanes tie by name) is kept up to date as its
    queue changes."""

    def __init__(self, graph: TaskGraph) -> None:
        self.graph = graph
        tab = self.tab = Tables(graph)
        n = self.n = len(graph.tasks)
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        self.waiting = waiting = tab.waiting
        self.allocs, self.mode, self.amount = tab.allocs, tab.mode, tab.amount
        self.refs = tab.refs
        n_lanes = len(tab.lane_names)
        # in-order lanes: their tasks by seq and the next one; the others: heaps of
        # (seq, task) of their ready tasks. Each lane's tasks by seq, ties by id (a
        # stable sort of a list in id order)
        self.queue: list[list[int]] = [[] for _ in range(n_lanes)]
        for tid, lane in enumerate(tab.lane_of):
            self.queue[lane].append(tid)
        seq = tab.seq
        self.head = [0] * n_lanes
        self.ready: list[list | None] = [None] * n_lanes
        self.urgency: list[tuple] = [(_NEVER, lane) for lane in range(n_lanes)]
        for lane, ids in enumerate(self.queue):
            ids.sort(key=seq.__getitem__)
            if lane in tab.in_order:
                self.urgency[lane] = (seq[ids[0]], lane)
            else:
                heap = self.ready[lane] = [(seq[i], i) for i in ids if not waiting[i]]
                heapq.heapify(heap)
                if heap:
                    self.urgency[lane] = (heap[0][0], lane)
        self.busy = [False] * n_lanes
        self.to_check = set(range(n_lanes))
        # the ledger: bytes in use and the peak per device; the memory steps and order
        # per device, made when the device first changes (dicts keep that order)
        n_dev = len(tab.devices)
        self.in_use = [0.0] * n_dev
        self.peak_of = [0.0] * n_dev
        self.peak: dict[str, float] = {d: 0.0 for d in graph.memory_capacity}
        self.steps: list[list | None] = [None] * n_dev
        self.orders: list[list] = [[] for _ in range(n_dev)]
        self.memory: dict[str, list[tuple[float, float]]] = {}
        self.order: dict[str, list[tuple[int, bool]]] = {}
        self.waits_on: dict[int, set[int]] = {}  # device -> lanes whose copy waits for room
        self.computing: list[tuple[float, int]] = []  # (end time, task)
        self.moving: dict[int, float] = {}  # transfer -> bytes left
        self.rates: dict[int, float] = {}
        self.shares: dict[tuple[int, ...], list[float]] = {}  # routes moving -> their rates
        self.now, self.done = 0.0, 0
        self.rates_stale = False

    def run(self) -> Played:
        while self.done < self.n:
            self.start_what_can()
            if self.done == self.n:
                break
            if self.computing or self.moving or not self.start_held_back():
                self.advance()
        return Played(self.start, self.end, self.peak, self.memory, self.order)

    def charge(self, buffers: list[int], allocated: bool) -> None:
        """Charge (``allocated``) or credit each of ``buffers`` to its device, in order."""
        tab, now = self.tab, self.now
        in_use, steps_of, orders, peak_of = self.in_use, self.steps, self.orders, self.peak_of
        buffer_device, buffer_bytes = tab.buffer_device, tab.buffer_bytes
        for b in buffers:
            device = buffer_device[b]
            if allocated:
                used = in_use[device] = in_use[device] + buffer_bytes[b]
            else:
                used = in_use[device] = in_use[device] + -buffer_bytes[b]
            steps = steps_of[device]
            if steps is None:
                name = tab.devices[device]
                steps = steps_of[device] = self.memory[name] = []
                self.order[name] = orders[device]
            steps.append((now, used))
            orders[device].append((b, allocated))
            if used > peak_of[device]:
                peak_of[device] = self.peak[tab.devices[device]] = used

    def begin(self, lane: int, tid: int) -> None:
        self.busy[lane] = True
        self.start[tid] = now = self.now
        allocs = self.allocs[tid]
        if allocs:
            self.charge(allocs, True)
        mode = self.mode[tid]
        if mode == MOVES:
            self.moving[tid] = self.amount[tid]
            self.rates_stale = True
        elif mode == COMPUTES:
            heapq.heappush(self.computing, (now + self.amount[tid], tid))
        else:
            self.finish([tid])

    def finish(self, ended: list[int]) -> None:
        """End the tasks ``ended``, in order: free what they release, and mark the lanes
        that may start something now."""
        tab, to_check, end, now = self.tab, self.to_check, self.end, self.now
        refs, waits_on, all_releases = self.refs, self.waits_on, tab.releases
        lane_of, busy, waiting, ready = tab.lane_of, self.busy, self.waiting, self.ready
        seq, urgency, queue, head = tab.seq, self.urgency, self.queue, self.head
        dependents, buffer_device = tab.dependents, tab.buffer_device
        for tid in ended:
            end[tid] = now
            self.done += 1
            releases = all_releases[tid]
            if releases:
                freed = []
                for b in releases:
                    refs[b] -= 1
                    if refs[b] == 0:
                        freed.append(b)
                if freed:
                    self.charge(freed, False)
                    if waits_on:
                        for b in freed:
                            if buffer_device[b] in waits_on:
                                to_check.update(waits_on.pop(buffer_device[b]))
            # Only lanes that may start something are checked (the others would be passed
            # over): a free lane whose next task is ready, or one with a copy waiting for
            # room.
            lane = lane_of[tid]
            busy[lane] = False
            heap = ready[lane]
            if heap is not None:
                if heap:
                    to_check.add(lane)
            else:  # an in-order lane: whether its next task may start
                at = head[lane]
                if at < len(queue[lane]) and not waiting[queue[lane][at]]:
                    to_check.add(lane)
            for d in dependents[tid]:
                waiting[d] -= 1
                if waiting[d] == 0:
                    dl = lane_of[d]
                    heap = ready[dl]
                    if heap is not None:
                        heapq.heappush(heap, (seq[d], d))
                        if heap[0][1] == d:
                            urgency[dl] = (seq[d], dl)
                        if not busy[dl]:
                            to_check.add(dl)
                    elif not busy[dl] and queue[dl][head[dl]] == d:
                        to_check.add(dl)

    def start_what_can(self) -> None:
        """Start what can start now, the most urgent lane first."""
        to_check, busy, ready, urgency = self.to_check, self.busy, self.ready, self.urgency
        queue, head, waiting, begin = self.queue, self.head, self.waiting, self.begin
        room = self.tab.room
        while to_check:
            # Urgencies change only when a task ends: until one does, one sort of the
            # lanes to check gives the order a min per lane would
            lanes = sorted(to_check, key=urgency.__getitem__) if len(to_check) > 1 else [*to_check]
            to_check.clear()
            done = self.done
            for i, lane in enumerate(lanes):
                if busy[lane]:
                    continue
                heap = ready[lane]
                if heap is not None:
                    if not heap:
                        continue
                    tid = heap[0][1]
                    need = room[tid]
                    if need is not None and self.waits_for_room(lane, need):
                        continue
                    heapq.heappop(heap)
                    urgency[lane] = (heap[0][0], lane) if heap else (_NEVER, lane)
                else:
                    ids, at = queue[lane], head[lane]
                    if at >= len(ids) or waiting[ids[at]]:
                        continue
                    tid = ids[at]
                    head[lane] = at = at + 1
                    urgency[lane] = (
                        (self.tab.seq[ids[at]], lane) if at < len(ids) else (_NEVER, lane)
                    )
                begin(lane, tid)
                if self.done != done:  # it ended at once: lanes may have been added, reordered
                    to_check.update(lanes[i + 1 :])
                    break

    def waits_for_room(self, lane: int, need: list[tuple[int, float, float]]) -> bool:
        """Whether a device has no room yet for what the copy at the head of ``lane``
        allocates (``need``: device, bytes, capacity); the lane then waits on it."""
        in_use = self.in_use
        for device, nbytes, limit in need:
            if in_use[device] + nbytes > limit:
                self.waits_on.setdefault(device, set()).add(lane)
                return True
        return False

    def start_held_back(self) -> bool:
        """Where nothing runs (the caller knows), so nothing will be freed, the most
        urgent copy waiting for room starts anyway; whether one did."""
        ready = self.ready
        held_back = [lane for lanes_ in self.waits_on.values() for lane in lanes_ if ready[lane]]
        if not held_back:
            return False
        lane = min(held_back, key=lambda x: ready[x][0])
        self.waits_on.clear()
        heap = ready[lane]
        tid = heapq.heappop(heap)[1]
        self.urgency[lane] = (heap[0][0], lane) if heap else (_NEVER, lane)
        self.begin(lane, tid)
        self.to_check.update(held_back)
        return True

    def fair_rates(self) -> dict[int, float]:
        """The rates of the transfers moving. They depend only on the routes moving,
        in the order the transfers began (:func:`fair_rates` fills in that order), so
        a play computes each such sequence once."""
        moving, route = self.moving, self.tab.route
        key = tuple([route[tid] for tid in moving])
        shares = self.shares.get(key)
        if shares is None:
            routes = self.tab.routes
            rates = fair_rates({i: routes[r] for i, r in enumerate(key)}, self.graph.links)
            shares = self.shares[key] = [rates[i] for i in range(len(key))]
        return dict(zip(moving, shares))

    def advance(self) -> None:
        """Advance the clock to the next end, and finish what ends then."""
        moving, computing, now = self.moving, self.computing, self.now
        t_next = computing[0][0] if computing else math.inf
        ended = []
        if moving:
            if self.rates_stale:
                self.rates = self.fair_rates()
                self.rates_stale = False
            rates = self.rates
            finish_at = {tid: now + left / rates[tid] for tid, left in moving.items()}
            t_next = min(t_next, min(finish_at.values()))
            dt = t_next - now
            # ends by its finish time, not by bytes left: `now + tiny` can round to `now`
            by = t_next * (1 + 1e-12) + _EPS
            for tid, at in finish_at.items():
                if at <= by:
                    del moving[tid]
                    ended.append(tid)
                    self.rates_stale = True
                else:
                    moving[tid] -= rates[tid] * dt
        if t_next == math.inf:
            raise _deadlock(self.graph, self.start, self.end)
        self.now = now = t_next
        by = now + _EPS
        while computing and computing[0][0] <= by:
            ended.append(heapq.heappop(computing)[1])
        self.finish(ended)


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
    with gc_paused():
        return _trace(graph, play(graph))


def _trace(graph: TaskGraph, played: Played) -> Trace:
    return Trace.from_run(
        graph,
        played.start,
        played.end,
        [t.nbytes for t in graph.tasks],
        played.peak,
        played.memory,
    )
