"""Many models on one server: HYDRA's multi-model schedules for model selection.

This is planning, not a policy: placing units needs each model's simulated
solo iteration (its durations and footprints), and policies do not simulate.

Model selection trains several models on the same GPUs: a learning-rate grid of
one network, a few depths. Each model is a :class:`Job`: its cost model, its
single-GPU plan (any policy whose graph is built for one GPU) and how many
iterations to train. Three schedules share the server:

* ``sequential``: one model after another, each on all the GPUs its own
  ``parallel_plan`` uses; a job without one runs its single-GPU plan on gpu0
  while the other GPUs idle.
* ``task-parallel``: one model per GPU at a time: whole models, longest first,
  each to the GPU that frees first.
* ``merged`` (HYDRA's shard scheduling): the models' graphs are cut into
  *units*; whenever a GPU frees, it takes the next unit of the model with the
  longest remaining work among those whose previous unit has ended (longest
  remaining time first, on the durations of each model's simulated solo
  iteration). Each model's units keep their order: a unit starts after the
  model's previous one has started, each op once its inputs are there (on
  another GPU, a pack may begin its first microbatch while the previous pack
  finishes its last).

**Unit.** One weight group of one iteration of a model's graph: the load of a
pack's weights (W_IN), the pack's compute over all its microbatches (the FWD,
BWD or FWDBWD tasks that share that load), the inputs brought in for them, what
they send out (stashed inputs, activations or their gradients, the pack's
gradient) and the CPU update of that gradient. A task belongs to the unit of
the compute op its ``seq`` names (see :mod:`harmony.graph`). Harmony's grouped
packs give one unit per pack pass; virtual-memory one per pack and microbatch.
In the merged schedule a model's next unit may run on another GPU, so its plan
runs with ``offload_activations``: a unit takes its inputs from host memory and
leaves its outputs there (HYDRA's spilling), and every buffer a unit allocates
is freed by the unit's own tasks.

**One graph.** A schedule becomes one :class:`~harmony.graph.TaskGraph`, which
:func:`~harmony.simulate.simulate_graph` plays (one Trace; its ``model`` column
is the job) and the engine runs (:func:`harmony.engine.multi_model.train_many`). Each unit's tasks move to
its GPU (lanes ``gpu0.*`` -> ``gpuK.*``, with their links and buffers); the CPU
update lanes are shared. Units get ``seq`` in the order the schedule starts
them, so each GPU's compute lane runs its units in that order and every
dependency comes first: the graph cannot deadlock. A model's iterations follow
each other as in the engine: one starts when every task of the previous one has
ended.

**Memory.** A GPU's compute lane runs one unit at a time. The builder's
prefetch windows are rebuilt per GPU over the merged order: a unit's weight
load waits for the unit ``prefetch_packs`` back on its GPU to end its compute,
an op's inputs for the op two back. Where that would make a unit share its GPU
with units other than the ones it shares it with alone (another model's, or
not its model's previous ones), the window is narrowed until the *footprints*
of the units sharing the GPU fit its memory (a unit's footprint: the peak of
its own buffers in its model's solo simulation), and the unit's loads and
inputs wait until the unit before the window has ended all its GPU tasks
(gradient and outputs sent). The simulated peak per GPU
(``trace.summary.fits``) checks this estimate; in :func:`train_many` the
emulated GPUs' ledgers enforce the capacity.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import pandas as pd

from ..errors import HarmonyError, OutOfMemoryError
from ..graph import G_OUT, IN_ORDER_KINDS, W_IN, Buffer, Task, TaskGraph
from ..costs.hardware import Hardware
from ..plan import Plan
from ..policies import build_graph
from ..simulate import play, simulate_graph
from ..costs.spec import ModelSpec
from ..trace import Trace

SCHEDULES = ("sequential", "task-parallel", "merged")


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
            raise HarmonyError(f"a Job takes a harmony.ModelSpec and a harmony.Plan, got "
                               f"{type(self.spec).__name__} and {type(self.plan).__name__}")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise HarmonyError(f"job {self.label!r}: steps must be a positive integer, got {self.steps!r}")
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
class _Solo:
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


def _cut(graph: TaskGraph, plan: Plan) -> _Solo:
    tasks = graph.tasks
    unit_of_op: dict[int, int] = {}
    load_unit: dict[int, int] = {}
    gpu: list[int] = []
    last_op: list[int] = []
    for t in sorted((t for t in tasks if t.kind in IN_ORDER_KINDS), key=lambda t: t.seq):
        loads = [d for d in t.deps if tasks[d].kind == W_IN]
        if len(loads) != 1:
            raise HarmonyError(f"{graph.info.get('policy')} graph: compute task '{t.what}' waits on {len(loads)} "
                               "weight loads; the multi-model schedules cut a graph into units at its weight loads")
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
    return _Solo(graph, unit_of, gpu, rank, members, data, [t.id for t in tasks if t.id not in waited],
                 plan.option("prefetch_packs"), duration,
                 _footprints(graph, unit_of, len(gpu), start, end), iteration, max(peak.values(), default=0.0))


def _data_deps(graph: TaskGraph, t: Task) -> list[int]:
    """``t``'s dependencies less the builder's memory windows: a weight load waits
    only on its window (and on the gradients some policies send out before it
    loads, which it keeps); an op's input transfer on the op two back on its GPU."""
    if t.kind == W_IN:
        return [d for d in t.deps if graph.tasks[d].kind == G_OUT]
    if t.is_transfer and t.seq[1] == 0:
        return [d for d in t.deps if not (graph.tasks[d].kind in IN_ORDER_KINDS and graph.tasks[d].device == t.device)]
    return list(t.deps)


def _footprints(graph: TaskGraph, unit_of: list[int], n: int, start: list[float], end: list[float]) -> list[float]:
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
        for _, delta in sorted(ev, key=lambda e: (e[0], e[1])):  # frees first at equal times, as the simulator
            now += delta
            top = max(top, now)
        out.append(top)
    return out


# ---- the schedules ------------------------------------------------------------------
def _sequential(jobs: list[Job], solos: list[_Solo], n_gpus: int) -> list[Placement]:
    out, t = [], 0.0
    for m, (job, solo) in enumerate(zip(jobs, solos)):
        for s in range(job.steps):
            for u, d in enumerate(solo.duration):
                out.append(Placement(m, s, u, solo.gpu[u], t, t + d))
                t += d
    return out


def _task_parallel(jobs: list[Job], solos: list[_Solo], n_gpus: int) -> list[Placement]:
    free = [0.0] * n_gpus
    out = []
    for m in sorted(range(len(jobs)), key=lambda m: -jobs[m].steps * solos[m].iteration_s):
        k = min(range(n_gpus), key=free.__getitem__)
        for s in range(jobs[m].steps):
            for u, d in enumerate(solos[m].duration):
                out.append(Placement(m, s, u, k, free[k], free[k] + d))
                free[k] += d
    return sorted(out, key=lambda p: p.start_s)  # stable: each GPU's and each model's order stay


def _merged(jobs: list[Job], solos: list[_Solo], n_gpus: int) -> list[Placement]:
    """HYDRA's heuristic: the GPU that frees first takes the next unit of the
    model with the longest remaining work among those ready by then (else of
    the model ready soonest)."""
    left = [job.steps * solo.iteration_s for job, solo in zip(jobs, solos)]
    placed = [0] * len(jobs)
    ready = [0.0] * len(jobs)
    free = [0.0] * n_gpus
    out = []
    while True:
        active = [m for m, job in enumerate(jobs) if placed[m] < job.steps * len(solos[m].duration)]
        if not active:
            return sorted(out, key=lambda p: p.start_s)
        k = min(range(n_gpus), key=free.__getitem__)
        waiting = [m for m in active if ready[m] <= free[k]]
        m = (max(waiting, key=left.__getitem__) if waiting
             else min(active, key=lambda m: (ready[m], -left[m])))
        s, u = divmod(placed[m], len(solos[m].duration))
        d = solos[m].duration[u]
        begin = max(free[k], ready[m])
        out.append(Placement(m, s, u, k, begin, begin + d))
        free[k] = ready[m] = begin + d
        left[m] -= d
        placed[m] += 1


_PLACERS: dict[str, Callable] = {"sequential": _sequential, "task-parallel": _task_parallel, "merged": _merged}


# ---- one graph for a schedule ---------------------------------------------------------
@dataclass
class MultiSchedule:
    """A schedule of several models as one task graph.

    ``origin[i]``: (job, iteration, task id in the job's iteration graph) of merged
    task ``i``; ``views[(job, iteration)]``: that iteration's graph with every unit
    on the GPU the schedule gave it (same task and buffer ids as the job's graph)."""

    schedule: str
    jobs: list[Job]
    hardware: Hardware
    graph: TaskGraph
    placements: list[Placement]
    origin: list[tuple[int, int, int]]
    views: dict[tuple[int, int], TaskGraph]

    def units(self) -> pd.DataFrame:
        """One row per placed unit, in the order the schedule starts them."""
        return pd.DataFrame([{"model": p.job, "name": self.jobs[p.job].label, "step": p.step, "unit": p.unit,
                              "gpu": p.gpu, "est_start_s": p.start_s, "est_end_s": p.end_s}
                             for p in self.placements])


def _renamer(src: int, dst: int, hw: Hardware) -> Callable[[str], str]:
    """Rename a device, lane or link of GPU ``src`` to GPU ``dst``."""
    heads = {f"gpu{src}": f"gpu{dst}", f"switch{hw.switch_of(src)}": f"switch{hw.switch_of(dst)}"}

    def rename(name: str) -> str:
        head, dot, tail = name.partition(".")
        return heads.get(head, head) + dot + tail

    return rename


def _view(solo: _Solo, gpus: dict[int, int], hw: Hardware, label: str) -> TaskGraph:
    """The iteration graph with unit ``u`` on GPU ``gpus[u]``."""
    g = solo.graph
    renames = {(solo.gpu[u], k): _renamer(solo.gpu[u], k, hw) for u, k in gpus.items()}
    tasks = []
    device_of: dict[int, set[str]] = defaultdict(set)
    for t in g.tasks:
        u = solo.unit_of[t.id]
        r = renames[(solo.gpu[u], gpus[u])]
        tasks.append(replace(t, device=r(t.device), lane=r(t.lane), links=tuple(r(x) for x in t.links)))
        for b in (*t.allocs, *t.releases):
            device_of[b].add(r(g.buffers[b].device))
    buffers = []
    for b in g.buffers:
        where = device_of.get(b.id, {b.device})
        if len(where) > 1:
            raise HarmonyError(
                f"job {label!r}: its {b.what} is used on {' and '.join(sorted(where))}: a buffer that outlives "
                "its unit cannot follow the model to another GPU; the merged schedule needs a policy that sends "
                "each unit's outputs through host memory when offload_activations is on (as harmony's do)")
        buffers.append(replace(b, device=where.pop()))
    links = {r(name): rate for r in renames.values() for name, rate in g.links.items()}
    capacity = {f"gpu{k}": float(hw.gpu_memory) for k in range(hw.n_gpus)}
    return TaskGraph(tasks, buffers, links, capacity, g.samples, g.cpu_workers, dict(g.info))


@dataclass
class _OnGpu:
    """A unit as placed on a GPU: what later units' windows wait on."""

    key: tuple[int, int]  # (job, iteration)
    rank: int
    footprint: float
    last: int = -1  # its last compute task
    outputs: list[int] = field(default_factory=list)  # what it sends from the GPU after computing
    gate: list[int] = field(default_factory=list)  # what its inputs wait on besides the op window


class _Merger:
    """Emits the units of every placement into one graph (see the module notes)."""

    def __init__(self, sched: str, jobs: list[Job], solos: list[_Solo], placements: list[Placement], hw: Hardware):
        self.jobs, self.solos, self.hw = jobs, solos, hw
        gpus: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        for p in placements:
            gpus[(p.job, p.step)][p.unit] = p.gpu
        self.views = {key: _view(solos[key[0]], g, hw, jobs[key[0]].label) for key, g in gpus.items()}
        self.tasks: list[Task] = []
        self.buffers: list[Buffer] = []
        self.origin: list[tuple[int, int, int]] = []
        self.new_id: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        self.offset: dict[tuple[int, int], int] = {}
        self.ops_on: dict[int, list[int]] = defaultdict(list)
        self.units_on: dict[int, list[_OnGpu]] = defaultdict(list)
        self.placed: dict[tuple[int, int, int], _OnGpu] = {}
        self.n_ops = 0
        # Consecutive placements of one iteration form a block, emitted in the job graph's own order.
        blocks: list[tuple[tuple[int, int], list[int]]] = []
        for p in placements:
            if blocks and blocks[-1][0] == (p.job, p.step):
                blocks[-1][1].append(p.unit)
            else:
                blocks.append(((p.job, p.step), [p.unit]))
        for key, units in blocks:
            self._block(key, units)
        samples = sum(job.steps * solo.graph.samples for job, solo in zip(jobs, solos))
        links = {name: rate for view in self.views.values() for name, rate in view.links.items()}
        self.graph = TaskGraph(
            self.tasks, self.buffers, links, {f"gpu{k}": float(hw.gpu_memory) for k in range(hw.n_gpus)},
            samples, hw.cpu_update_workers,
            {"policy": f"multi-model {sched}", "model": ", ".join(job.label for job in jobs), "hardware": hw.name,
             "schedule": sched})

    def _block(self, key: tuple[int, int], units: list[int]) -> None:
        m, s = key
        solo, view = self.solos[m], self.views[key]
        if key not in self.offset:
            self.offset[key] = len(self.buffers)
            self.buffers += [replace(b, id=b.id + self.offset[key]) for b in view.buffers]
        ids = sorted((i for u in units for i in solo.tasks[u]), key=lambda i: solo.graph.tasks[i].seq)
        op_new = {}
        for i in ids:
            if solo.graph.tasks[i].kind in IN_ORDER_KINDS:
                self.n_ops += 1
                op_new[solo.graph.tasks[i].seq[0]] = self.n_ops
        for i in ids:
            self._task(m, s, view.tasks[i], op_new)

    def _task(self, m: int, s: int, t: Task, op_new: dict[int, int]) -> None:
        solo, key = self.solos[m], (m, s)
        u = solo.unit_of[t.id]
        data = solo.data_deps[t.id]
        deps = [self.new_id[key][d] for d in data]
        if s > 0 and not data:  # the previous iteration first: its updates, then these weights
            prev = self.new_id[(m, s - 1)]
            deps += [prev[i] for i in solo.sinks]
        on_gpu = t.device.startswith("gpu")
        k = int(t.device[3:]) if on_gpu else -1
        if t.kind == W_IN:
            unit = _OnGpu(key, solo.rank[u], solo.footprint[u])
            deps += self._window(k, unit, solo.prefetch)
            self.units_on[k].append(unit)
            self.placed[(m, s, u)] = unit
        elif on_gpu and t.is_transfer and t.seq[1] == 0:
            deps += self.ops_on[k][-2:-1] + self.placed[(m, s, u)].gate
        off = self.offset[key]
        new = replace(t, id=len(self.tasks), seq=(op_new[t.seq[0]], *t.seq[1:]), deps=sorted(set(deps)),
                      io=_shift_io(t.io, off), allocs=[b + off for b in t.allocs],
                      releases=[b + off for b in t.releases])
        self.tasks.append(new)
        self.origin.append((m, s, t.id))
        self.new_id[key][t.id] = new.id
        if t.kind in IN_ORDER_KINDS:
            self.ops_on[k].append(new.id)
            self.placed[(m, s, u)].last = new.id
        elif on_gpu and t.seq[1] == 2:
            self.placed[(m, s, u)].outputs.append(new.id)

    def _window(self, k: int, unit: _OnGpu, prefetch: int) -> list[int]:
        """What the weight load of ``unit``, next on GPU ``k``, waits on."""
        on = self.units_on[k]
        i = len(on)
        for w in range(prefetch, 0, -1):
            before = on[i - w] if i >= w else None
            inside = on[max(0, i - w + 1):]
            run = ([before] if before else []) + inside + [unit]
            if all(r.key == unit.key for r in run) and [r.rank for r in run] == list(range(run[0].rank, unit.rank + 1)):
                return [before.last] if before else []  # as the model's own plan does alone
            if w == 1 or sum(r.footprint for r in inside) + unit.footprint <= self.hw.gpu_memory:
                unit.gate = [before.last, *before.outputs] if before else []
                return unit.gate
        raise AssertionError("prefetch_packs >= 1")


def _shift_io(io: dict, off: int) -> dict:
    def shift(v):
        if isinstance(v, int):
            return v + off
        if isinstance(v, list):
            return [x + off for x in v]
        return {layer: x + off for layer, x in v.items()}

    return {role: shift(v) for role, v in io.items()}


# ---- entry points ---------------------------------------------------------------------
def _plan_for(job: Job, schedule: str) -> Plan:
    if schedule == "sequential":
        return job.parallel_plan or job.plan
    if schedule == "merged" and not job.plan.option("offload_activations"):
        return replace(job.plan, options={**dict(job.plan.options), "offload_activations": True})
    return job.plan


def _check(jobs, hardware: Hardware, schedule: str) -> list[Job]:
    if schedule not in SCHEDULES:
        raise HarmonyError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if not isinstance(hardware, Hardware):
        raise HarmonyError(f"hardware must be a harmony.Hardware (e.g. harmony.preset('paper-4x1080ti')), "
                           f"got {type(hardware).__name__}")
    jobs = list(jobs)
    if not jobs:
        raise HarmonyError("no jobs: give a list of harmony.Job(spec, plan, steps), one per model to train")
    for i, job in enumerate(jobs):
        if not isinstance(job, Job):
            raise HarmonyError(f"jobs[{i}] is a {type(job).__name__}, not a harmony.Job(spec, plan, steps)")
        if schedule != "sequential" and job.plan.n_gpus != 1:
            raise HarmonyError(
                f"job {job.label!r}: the {schedule} schedule runs each model on one GPU at a time, but its plan "
                f"is for {job.plan.n_gpus} GPUs ({hardware.name!r} has {hardware.n_gpus}); give it a 1-GPU plan "
                "(a plan over several GPUs goes in parallel_plan, for the sequential schedule)")
    return jobs


def schedule_many(jobs: Sequence[Job], hardware: Hardware, schedule: str = "merged") -> MultiSchedule:
    """Place every job's units on ``hardware``'s GPUs by ``schedule`` (one of
    :data:`SCHEDULES`) and build the one task graph that runs them all."""
    jobs = _check(jobs, hardware, schedule)
    solos = []
    for m, job in enumerate(jobs):
        plan = _plan_for(job, schedule)
        solo = _cut(build_graph(job.spec, hardware, plan, model=m), plan)
        if solo.peak > hardware.gpu_memory:
            raise OutOfMemoryError(
                f"job {job.label!r}: its plan alone needs {solo.peak / 1e6:.1f} MB on a GPU, more than the "
                f"{hardware.gpu_memory / 1e6:.1f} MB of {hardware.name!r}; pick a plan that fits (harmony.search)")
        solos.append(solo)
    placements = _PLACERS[schedule](jobs, solos, hardware.n_gpus)
    merger = _Merger(schedule, jobs, solos, placements, hardware)
    return MultiSchedule(schedule, jobs, hardware, merger.graph, placements, merger.origin, merger.views)


@dataclass
class MultiRun:
    """Several models trained together: the schedule, its Trace (simulated or
    measured) and, from :func:`train_many`, each model's loss per step."""

    schedule: MultiSchedule
    trace: Trace
    losses: list[list[float]] | None = None

    @property
    def total_s(self) -> float:
        """Time to train every model: from the first task to the last."""
        return self.trace.iteration_s

    def finish_s(self) -> pd.Series:
        """When each model's last task ended."""
        tl = self.trace.timeline
        ends = tl.groupby("model").end_s.max()
        return pd.Series({job.label: ends.get(m, float("nan")) for m, job in enumerate(self.schedule.jobs)},
                         name="finish_s")

    def row(self) -> dict:
        """The run in one table row (see :func:`compare_schedules`)."""
        tl, s = self.trace.timeline, self.trace.summary
        gpus = len(self.schedule.graph.memory_capacity)
        compute = tl[tl.kind.isin(sorted(IN_ORDER_KINDS))]
        return {"schedule": self.schedule.schedule, "models": len(self.schedule.jobs), "gpus": gpus,
                "total_s": self.total_s, "samples_per_s": s.samples_per_s,
                "gpu_busy": float((compute.end_s - compute.start_s).sum()) / (gpus * self.total_s),
                "swap_gb": s.swap_bytes / 1e9, "peak_gb": max(s.peak_memory.values(), default=0.0) / 1e9,
                "fits": s.fits}


def simulate_many(jobs: Sequence[Job], hardware: Hardware, schedule: str = "merged") -> MultiRun:
    """Simulate training every job (its ``steps`` iterations) together on ``hardware``."""
    sched = schedule_many(jobs, hardware, schedule)
    return MultiRun(sched, simulate_graph(sched.graph))


def compare_schedules(jobs: Sequence[Job], hardware: Hardware, schedules: Sequence[str] = SCHEDULES) -> pd.DataFrame:
    """Simulated time to train every job under each schedule, one row per schedule;
    ``over_merged``: its time over the merged schedule's."""
    df = pd.DataFrame([simulate_many(jobs, hardware, name).row() for name in schedules])
    if "merged" in list(schedules):
        df["over_merged"] = df.total_s / df.loc[df.schedule == "merged", "total_s"].iloc[0]
    df.attrs.update(hardware=hardware.name, models=[job.label for job in jobs])
    return df


# ---- for real, on an emulated server -------------------------------------------------------
