"""A task graph as the flat lists :mod:`harmony.simulate`'s player indexes by
task, lane, buffer and device: read once per play, so that its event loop
touches no Task or Buffer."""

from __future__ import annotations

from .graph import IN_ORDER_KINDS, TRANSFER_KINDS, TaskGraph

#: how a task ends once started: after its duration (compute), when its bytes have
#: moved (a transfer with bytes), or at once
COMPUTES, MOVES, AT_ONCE = 0, 1, 2


class Tables:
    """Per task: its lane (a number; lanes numbered by name, ``lane_names``), seq,
    dependencies left (``waiting``), dependents, buffers allocated and released,
    how it ends (``mode``), its duration or bytes (``amount``), its route (a number
    into ``routes``: links, rate cap, costs) and, for a copy that allocates on a
    device with a capacity, the room it needs there (``room``). Per buffer: its
    device (a number into ``devices``), bytes and releases (``refs``). Lanes that
    run in seq order: ``in_order``."""

    def __init__(self, graph: TaskGraph) -> None:
        tasks, buffers = graph.tasks, graph.buffers
        n = len(tasks)
        kinds = [t.kind for t in tasks]
        lanes = [t.lane for t in tasks]
        deps = [t.deps for t in tasks]
        lane_names = sorted(set(lanes))  # lanes tie by name
        lane_no = {name: i for i, name in enumerate(lane_names)}
        self.lane_names = lane_names
        self.lane_of = list(map(lane_no.__getitem__, lanes))
        self.in_order = {lane_no[ln] for kind, ln in zip(kinds, lanes) if kind in IN_ORDER_KINDS}
        self.seq = [t.seq for t in tasks]
        self.waiting = list(map(len, deps))
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        dependents = self.dependents
        for tid, ds in enumerate(deps):
            for d in ds:
                dependents[d].append(tid)
        self.allocs = [t.allocs for t in tasks]
        self.releases = [t.releases for t in tasks]
        devices = list(graph.memory_capacity)
        devices += sorted({b.device for b in buffers} - set(devices))
        self.devices = devices
        dev_no = {d: i for i, d in enumerate(devices)}
        self.buffer_device = [dev_no[b.device] for b in buffers]
        self.buffer_bytes = [b.nbytes for b in buffers]
        self.refs = [b.refs for b in buffers]
        self._ends(graph, kinds)

    def _ends(self, graph: TaskGraph, kinds: list[str]) -> None:
        """How each task ends and its duration or bytes; for a transfer with bytes,
        its route (links, rate cap, costs: what its fair rate depends on); for a copy
        that allocates on a device with a capacity, what it needs there: (device,
        bytes, capacity) per such device, in the order of its buffers."""
        tasks, n = graph.tasks, len(kinds)
        self.mode = mode = [AT_ONCE] * n
        self.amount = amount = [0.0] * n
        self.route = route = [-1] * n
        self.room: list[list[tuple[int, float, float]] | None] = [None] * n
        self.routes: list[tuple] = []
        route_no: dict[tuple, int] = {}
        # the devices with a capacity come first in self.devices
        limits = [c * (1 + 1e-12) for c in graph.memory_capacity.values()]
        buffer_device, buffer_bytes = self.buffer_device, self.buffer_bytes
        for tid, kind in enumerate(kinds):
            t = tasks[tid]
            if kind not in TRANSFER_KINDS:
                if t.duration > 0:
                    mode[tid], amount[tid] = COMPUTES, t.duration
                continue
            if t.nbytes > 0:
                mode[tid], amount[tid] = MOVES, t.nbytes
                links, costs = t.links, t.costs
                # Task.link_costs: a cost of 1 on each link when it names none
                key = (links, t.max_rate, costs or (1.0,) * len(links))
                no = route_no.get(key)
                if no is None:
                    no = route_no[key] = len(self.routes)
                    self.routes.append(key)
                route[tid] = no
            if t.allocs:
                need: dict[int, float] = {}
                for b in t.allocs:
                    device = buffer_device[b]
                    if device < len(limits) and buffer_bytes[b] > 0:
                        need[device] = need.get(device, 0.0) + buffer_bytes[b]
                if need:
                    self.room[tid] = [(d, nbytes, limits[d]) for d, nbytes in need.items()]
