"""One task graph for a multi-model schedule: each unit's tasks moved to the
GPU the schedule gives it, in the order the schedule starts them, with the
prefetch windows rebuilt per GPU (see :mod:`harmony.planner.multi_model`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

import pandas as pd

from ..costs.hardware import Hardware
from ..errors import HarmonyError
from ..graph import IN_ORDER_KINDS, REC, W_IN, Buffer, Task, TaskGraph
from .units import Job, Placement, Solo


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
        return pd.DataFrame(
            [
                {
                    "model": p.job,
                    "name": self.jobs[p.job].label,
                    "step": p.step,
                    "unit": p.unit,
                    "gpu": p.gpu,
                    "est_start_s": p.start_s,
                    "est_end_s": p.end_s,
                }
                for p in self.placements
            ]
        )


def _renamer(src: int, dst: int, hw: Hardware) -> Callable[[str], str]:
    """Rename a device, lane or link of GPU ``src`` to GPU ``dst``."""
    heads = {f"gpu{src}": f"gpu{dst}", f"switch{hw.switch_of(src)}": f"switch{hw.switch_of(dst)}"}

    def rename(name: str) -> str:
        head, dot, tail = name.partition(".")
        return heads.get(head, head) + dot + tail

    return rename


def _view(solo: Solo, gpus: dict[int, int], hw: Hardware, label: str) -> TaskGraph:
    """The iteration graph with unit ``u`` on GPU ``gpus[u]``."""
    g = solo.graph
    renames = {(solo.gpu[u], k): _renamer(solo.gpu[u], k, hw) for u, k in gpus.items()}
    tasks = []
    device_of: dict[int, set[str]] = defaultdict(set)
    for t in g.tasks:
        u = solo.unit_of[t.id]
        r = renames[(solo.gpu[u], gpus[u])]
        tasks.append(
            replace(t, device=r(t.device), lane=r(t.lane), links=tuple(r(x) for x in t.links))
        )
        for b in (*t.allocs, *t.releases):
            device_of[b].add(r(g.buffers[b].device))
    buffers = []
    for b in g.buffers:
        where = device_of.get(b.id, {b.device})
        if len(where) > 1:
            raise HarmonyError(
                f"job {label!r}: its {b.what} is used on {' and '.join(sorted(where))}: a buffer "
                "that outlives its unit cannot follow the model to another GPU; the merged "
                "schedule needs a policy that sends each unit's outputs through host memory when "
                "offload_activations is on (as harmony's do)"
            )
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


class Merger:
    """Emits the units of every placement into one graph (see the module notes)."""

    def __init__(
        self,
        sched: str,
        jobs: list[Job],
        solos: list[Solo],
        placements: list[Placement],
        hw: Hardware,
    ):
        self.jobs, self.solos, self.hw = jobs, solos, hw
        gpus: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        for p in placements:
            gpus[(p.job, p.step)][p.unit] = p.gpu
        self.views = {
            key: _view(solos[key[0]], g, hw, jobs[key[0]].label) for key, g in gpus.items()
        }
        self.tasks: list[Task] = []
        self.buffers: list[Buffer] = []
        self.origin: list[tuple[int, int, int]] = []
        self.new_id: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        self.offset: dict[tuple[int, int], int] = {}
        self.ops_on: dict[int, list[int]] = defaultdict(list)
        self.units_on: dict[int, list[_OnGpu]] = defaultdict(list)
        self.placed: dict[tuple[int, int, int], _OnGpu] = {}
        self.n_ops = 0
        # Consecutive placements of one iteration form a block, emitted in the job graph's own
        # order.
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
            self.tasks,
            self.buffers,
            links,
            {f"gpu{k}": float(hw.gpu_memory) for k in range(hw.n_gpus)},
            samples,
            hw.cpu_update_workers,
            {
                "policy": f"multi-model {sched}",
                "model": ", ".join(job.label for job in jobs),
                "hardware": hw.name,
                "schedule": sched,
            },
        )

    def _block(self, key: tuple[int, int], units: list[int]) -> None:
        m, s = key
        solo, view = self.solos[m], self.views[key]
        if key not in self.offset:
            self.offset[key] = len(self.buffers)
            self.buffers += [replace(b, id=b.id + self.offset[key]) for b in view.buffers]
        ids = sorted(
            (i for u in units for i in solo.tasks[u]), key=lambda i: solo.graph.tasks[i].seq
        )
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
        new = replace(
            t,
            id=len(self.tasks),
            seq=(op_new[t.seq[0]], *t.seq[1:]),
            deps=sorted(set(deps)),
            io=_shift_io(t.io, off),
            allocs=[b + off for b in t.allocs],
            releases=[b + off for b in t.releases],
        )
        self.tasks.append(new)
        self.origin.append((m, s, t.id))
        self.new_id[key][t.id] = new.id
        if t.kind in IN_ORDER_KINDS:
            if t.kind != REC:  # windows count ops, and a REC is the first half of its op
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
            inside = on[max(0, i - w + 1) :]
            run = ([before] if before else []) + inside + [unit]
            if all(r.key == unit.key for r in run) and [r.rank for r in run] == list(
                range(run[0].rank, unit.rank + 1)
            ):
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
