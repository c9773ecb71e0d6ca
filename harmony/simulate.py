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
    tasks = graph.tasks
    n = len(tasks)
    start = [math.nan] * n
    end = [math.nan] * n
    waiting = [len(t.deps) for t in tasks]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        for d in t.deps:
            dependents[d].append(t.id)
    lanes = graph.lanes()
    lane_of = {}
    for lane, ids in lanes.items():
        for i in ids:
            lane_of[i] = lane
    in_order = graph.in_order_lanes()
    head = {lane: 0 for lane in lanes}  # next task of an in-order lane
    ready: dict[str, list] = {
        lane: [] for lane in lanes if lane not in in_order
    }  # heaps of (seq, task)
    for lane, heap in ready.items():
        for i in lanes[lane]:
            if not waiting[i]:
                heap.append((tasks[i].seq, i))
        heapq.heapify(heap)
    busy = {lane: False for lane in lanes}
    refs = [b.refs for b in graph.buffers]
    costs = [t.link_costs() for t in tasks]
    capacity = graph.memory_capacity
    # what each copy allocates on a device with a capacity, and the lanes whose most
    # urgent ready copy waits for room on a device
    room: dict[int, dict[str, float]] = {}
    for t in tasks:
        if t.is_transfer:
            for b in t.allocs:
                buf = graph.buffers[b]
                if buf.device in capacity and buf.nbytes > 0:
                    need = room.setdefault(t.id, {})
                    need[buf.device] = need.get(buf.device, 0.0) + buf.nbytes
    waits_on: dict[str, set[str]] = defaultdict(set)
    in_use: dict[str, float] = defaultdict(float)
    peak: dict[str, float] = {d: 0.0 for d in graph.memory_capacity}
    memory: dict[str, list[tuple[float, float]]] = defaultdict(list)
    order: dict[str, list[tuple[int, bool]]] = defaultdict(list)

    computing: list[tuple[float, int]] = []  # (end time, task)
    moving: dict[int, float] = {}  # transfer -> bytes left
    rates: dict[int, float] = {}
    now, done = 0.0, 0
    to_check = set(lanes)
    rates_stale = False

    def charge(device: str, delta: float) -> None:
        in_use[device] += delta
        memory[device].append((now, in_use[device]))
        if in_use[device] > peak.get(device, 0.0):
            peak[device] = in_use[device]

    def fits(tid: int) -> str | None:
        """None, or a device that has no room yet for what copy ``tid`` allocates."""
        for device, nbytes in room.get(tid, {}).items():
            if in_use[device] + nbytes > capacity[device] * (1 + 1e-12):
                return device
        return None

    def begin(lane: str, tid: int) -> None:
        nonlocal rates_stale
        busy[lane] = True
        start[tid] = now
        t = tasks[tid]
        for b in t.allocs:
            buf = graph.buffers[b]
            charge(buf.device, buf.nbytes)
            order[buf.device].append((b, True))
        if t.is_transfer:
            if t.nbytes > 0:
                moving[tid] = t.nbytes
                rates_stale = True
            else:
                finish(tid)
        elif t.duration > 0:
            heapq.heappush(computing, (now + t.duration, tid))
        else:
            finish(tid)

    def finish(tid: int) -> None:
        nonlocal done
        end[tid] = now
        done += 1
        t = tasks[tid]
        for b in t.releases:
            refs[b] -= 1
            if refs[b] == 0:
                buf = graph.buffers[b]
                charge(buf.device, -buf.nbytes)
                order[buf.device].append((b, False))
                to_check.update(waits_on.pop(buf.device, ()))
        lane = lane_of[tid]
        busy[lane] = False
        to_check.add(lane)
        for d in dependents[tid]:
            waiting[d] -= 1
            if waiting[d] == 0:
                dl = lane_of[d]
                to_check.add(dl)
                if dl in ready:
                    heapq.heappush(ready[dl], (tasks[d].seq, d))

    def urgency(lane: str) -> tuple:
        """The seq of the task ``lane`` would start next (lanes that may start
        something go most urgent first, so the most urgent copy gets room first)."""
        if lane in ready:
            return ready[lane][0][0] if ready[lane] else (math.inf,)
        ids = lanes[lane]
        return tasks[ids[head[lane]]].seq if head[lane] < len(ids) else (math.inf,)

    while done < n:
        # Start what can start now.
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
        if done == n:
            break
        held_back = [lane for lanes_ in waits_on.values() for lane in lanes_ if ready[lane]]
        if not computing and not moving and held_back:
            # nothing runs, so nothing will be freed: the most urgent waiting copy goes
            lane = min(held_back, key=lambda x: ready[x][0])
            waits_on.clear()
            begin(lane, heapq.heappop(ready[lane])[1])
            to_check.update(held_back)
            continue
        if rates_stale:
            rates = fair_rates(
                {tid: (tasks[tid].links, tasks[tid].max_rate, costs[tid]) for tid in moving},
                graph.links,
            )
            rates_stale = False
        # Advance to the next end.
        t_next = computing[0][0] if computing else math.inf
        finish_at = {tid: now + left / rates[tid] for tid, left in moving.items()}
        if finish_at:
            t_next = min(t_next, min(finish_at.values()))
        if t_next == math.inf:
            raise _deadlock(graph, start, end)
        dt = t_next - now
        now = t_next
        ended = []
        for tid, at in finish_at.items():
            # ends by its finish time, not by bytes left: `now + tiny` can round to `now`
            if at <= now * (1 + 1e-12) + _EPS:
                del moving[tid]
                ended.append(tid)
                rates_stale = True
            else:
                moving[tid] -= rates[tid] * dt
        while computing and computing[0][0] <= now + _EPS:
            ended.append(heapq.heappop(computing)[1])
        for tid in ended:
            finish(tid)
    return Played(start, end, peak, dict(memory), dict(order))


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
