"""Jobs of the multi-model schedules, and one model's iteration cut into
*units* (see :mod:`harmony.planner.multi_model`) with what playing it alone says:
each unit's duration and memory footprint."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import G_OUT, IN_ORDER_KINDS, W_IN, Task, TaskGraph
from ..plan import Plan
from ..simulate import play


@dataclass(frozen=True)
class Job:
    """One model to train: its cost model, its single-GPU ``plan`` and the
    iterations to train. ``parallel_plan``: its own plan over several GPUs, for
    the sequential schedule (without one it runs ``plan`` on one GPU)."""

    spec: ModelSpec
    plan: Plan
    steps: int = 1
    name: str = ""
    parallel_plan: Plan | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ModelSpec) or not isinstance(self.plan, Plan):
            raise HarmonyError(
                f"a Job takes a harmony.ModelSpec and a harmony.Plan, got "
                f"{type(self.spec).__name__} and {type(self.plan).__name__}"
            )
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise HarmonyError(
                f"job {self.label!r}: steps must be a positive integer, got {self.steps!r}"
            )
        if self.parallel_plan is not None and not isinstance(self.parallel_plan, Plan):
            raise HarmonyError(f"job {self.label!r}: parallel_plan must be a harmony.Plan or None")

    @property
    def label(self) -> str:
        return self.name or self.spec.name


@dataclass(frozen=True)
class Placement:
    """Unit ``unit`` of iteration ``step`` of job ``job`` on GPU ``gpu``, with the
    start and end the schedule estimated for it."""

    job: int
    step: int
    unit: int
    gpu: int
    start_s: float
    end_s: float


# ---- a model alone ----------------------------------------------------------------
@dataclass
class Solo:
    """One iteration of a model's graph cut into units, and what playing it alone says."""

    graph: TaskGraph
    unit_of: list[int]  # task -> unit
    gpu: list[int]  # unit -> its GPU in the graph
    rank: list[int]  # unit -> its position among the graph's units on that GPU
    tasks: list[list[int]]  # unit -> its tasks, in seq order
    data_deps: list[list[int]]  # task -> its dependencies without the builder's memory windows
    sinks: list[int]  # tasks nothing in the iteration waits on (its updates, mostly)
    prefetch: int  # the plan's prefetch_packs
    duration: list[float]  # unit -> the time it adds to the solo iteration
    footprint: list[float]  # unit -> peak bytes of its own GPU buffers
    iteration_s: float
    peak: float


def cut(graph: TaskGraph, plan: Plan) -> Solo:
    tasks = graph.tasks
    unit_of_op: dict[int, int] = {}
    load_unit: dict[int, int] = {}
    gpu: list[int] = []
    last_op: list[int] = []
    for t in sorted((t for t in tasks if t.kind in IN_ORDER_KINDS), key=lambda t: t.seq):
        loads = [d for d in t.deps if tasks[d].kind == W_IN]
        if len(loads) != 1:
            raise HarmonyError(
                f"{graph.info.get('policy')} graph: compute task '{t.what}' waits on {len(loads)} "
                "weight loads; the multi-model schedules cut a graph into units at its weight "
                "loads"
            )
        u = load_unit.setdefault(loads[0], len(gpu))
        if u == len(gpu):
            gpu.append(int(t.device[3:]))
            last_op.append(t.id)
        unit_of_op[t.seq[0]] = u
        last_op[u] = t.id
    unit_of = [unit_of_op[t.seq[0]] for t in tasks]
    members: list[list[int]] = [[] for _ in gpu]
    for t in sorted(tasks, key=lambda t: t.seq):
        members[unit_of[t.id]].append(t.id)
    on_gpu: Counter = Counter()
    rank = []
    for g in gpu:
        rank.append(on_gpu[g])
        on_gpu[g] += 1

    start, end, peak, _ = play(graph)
    iteration = max(end, default=0.0)
    duration, reached = [], 0.0
    for op in last_op:
        duration.append(max(0.0, end[op] - reached))
        reached = max(reached, end[op])
    duration[-1] += iteration - reached  # the last updates
    data = [_data_deps(graph, t) for t in tasks]
    waited = {d for deps in data for d in deps}
    return Solo(
        graph,
        unit_of,
        gpu,
        rank,
        members,
        data,
        [t.id for t in tasks if t.id not in waited],
        plan.option("prefetch_packs"),
        duration,
        _footprints(graph, unit_of, len(gpu), start, end),
        iteration,
        max(peak.values(), default=0.0),
    )


def _data_deps(graph: TaskGraph, t: Task) -> list[int]:
    """``t``'s dependencies less the builder's memory windows: a weight load waits
    only on its window (and on the gradients some policies send out before it
    loads, which it keeps); an op's input transfer on the op two back on its GPU."""
    if t.kind == W_IN:
        return [d for d in t.deps if graph.tasks[d].kind == G_OUT]
    if t.is_transfer and t.seq[1] == 0:
        return [
            d
            for d in t.deps
            if not (graph.tasks[d].kind in IN_ORDER_KINDS and graph.tasks[d].device == t.device)
        ]
    return list(t.deps)


def _footprints(
    graph: TaskGraph, unit_of: list[int], n: int, start: list[float], end: list[float]
) -> list[float]:
    """Peak bytes of each unit's own GPU buffers over the solo play: a buffer is
    held from the start of the task that allocates it to the end of its last release."""
    held: dict[int, tuple[int, float]] = {}  # buffer -> (unit, from)
    until: dict[int, float] = defaultdict(float)
    for t in graph.tasks:
        for b in t.allocs:
            held[b] = (unit_of[t.id], start[t.id])
        for b in t.releases:
            until[b] = max(until[b], end[t.id])
    events: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    for b, (u, since) in held.items():
        buf = graph.buffers[b]
        if buf.device.startswith("gpu"):
            events[u] += [(since, buf.nbytes), (until[b], -buf.nbytes)]
    out = []
    for ev in events:
        now = top = 0.0
        for _, delta in sorted(
            ev, key=lambda e: (e[0], e[1])
        ):  # frees first at equal times, as the simulator
            now += delta
            top = max(top, now)
        out.append(top)
    return out
