"""Many models trained on one server at once (HYDRA's model selection), for real.

:func:`train_many` plays the schedule :func:`~harmony.planner.multi_model.schedule_many`
makes of the engines' jobs with one executor: each task is done by its model's
own step code, on the GPU the schedule gave its unit, and device memory is
taken in the order the simulator played the merged graph.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Sequence

from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import Task
from ..plan import Plan
from ..planner.multi_model import Job, MultiRun, MultiSchedule, schedule_many
from ..simulate import play
from ..trace import Trace
from .admission import MemoryOrder
from .describe import describe
from .devices import EmulatedServer, make_backends
from .executor import Executor
from .reference_loop import as_args
from .step import SharedDevices, StepRun, memory_checks
from .tiers.pacing import LinkPacer


def train_many(
    engines: Sequence,
    batches: Sequence[Sequence[tuple]],
    server,
    schedule: str = "merged",
    specs: Sequence[ModelSpec] | None = None,
) -> MultiRun:
    """Train each engine on its minibatches, all together on ``server``'s emulated GPUs.

    ``engines``: one :class:`~harmony.engine.Engine` per model, each made for one
    device with an explicit 1-GPU plan; ``batches[i]``: engine i's minibatches,
    one step each. The schedule's graph is played once, by one executor: each
    task is done by its model's own step code (the engine's
    :class:`~harmony.engine.step.run.StepRun` for that iteration), on the GPU the
    schedule gave its unit, charged to that GPU's ledger and paced on its links.
    Each model trains exactly as alone: the same ops in the same order, dropout
    seeded per (step, microbatch, layer) under one lock for all models, an
    iteration starting once the previous one has ended. ``specs``: the cost models the schedule's
    estimates come from (e.g. from :func:`harmony.profile`); default: the
    chains' sizes, without times, so units are ordered by their transfers.
    The sequential schedule runs each model's 1-GPU plan on gpu0."""

    engines, batches = list(engines), [list(b) for b in batches]
    if not isinstance(server, EmulatedServer):
        raise HarmonyError(
            f"train_many runs on a harmony.EmulatedServer, got {type(server).__name__}"
        )
    if not engines:
        raise HarmonyError("no engines: give one harmony.Engine per model, each with a 1-GPU plan")
    if len(batches) != len(engines) or (specs is not None and len(specs) != len(engines)):
        raise HarmonyError(
            f"{len(engines)} engines but {len(batches)} lists of minibatches"
            + ("" if specs is None else f" and {len(specs)} specs")
            + ": give one per engine"
        )
    if len({id(e.model) for e in engines}) != len(engines):
        raise HarmonyError(
            "two engines train the same model object: give each engine its own model"
        )
    jobs = [
        _job_of(m, engine, data, None if specs is None else specs[m])
        for m, (engine, data) in enumerate(zip(engines, batches))
    ]
    sched = schedule_many(jobs, server.hardware(), schedule)
    return _Training(sched, engines, batches, server).run()


def _job_of(m: int, engine, data: list[tuple], spec: ModelSpec | None) -> Job:

    label = f"{m}:{type(engine.model).__name__}"
    if not isinstance(engine.plan, Plan):
        raise HarmonyError(
            f"engine {label} has no plan: make it with plan=harmony.Plan(...) for one GPU"
        )
    if engine.sync is not None:
        raise HarmonyError(
            f"engine {label} is distributed across servers; train_many runs on one server"
        )
    if engine.host_settings.directory is not None:
        raise HarmonyError(
            f"engine {label} has a disk tier (disk_dir); train_many keeps every model's state "
            "in host memory: make it without one"
        )
    if not data:
        raise HarmonyError(f"engine {label} has no minibatches to train on")
    engine.lay_out_weights()  # and made, for a model built on the meta device
    for x, y in data:
        if y.shape[0] != engine.minibatch_size or any(
            t.shape[0] != engine.minibatch_size for t in as_args(x)
        ):
            raise HarmonyError(
                f"engine {label} takes minibatches of {engine.minibatch_size} samples, got "
                f"inputs {[tuple(t.shape) for t in as_args(x)]} and target {tuple(y.shape)}"
            )
    if spec is None:
        x, y = data[0]
        spec = engine.spec or describe(
            engine.layers, as_args(x), y, name=type(engine.model).__name__
        )
    return Job(spec, engine.plan, steps=len(data), name=label)


class _Training:
    """Plays a schedule's graph with one executor; each task goes to its model's
    :class:`~harmony.engine.step.run.StepRun` for that iteration, made when the
    iteration's first task starts (the previous one has ended by then)."""

    def __init__(self, sched: MultiSchedule, engines: list, batches: list[list[tuple]], server):

        self.sched, self.engines, self.batches = sched, engines, batches
        self.backends = {b.name: b for b in make_backends(server)}
        # the server's GPUs, shared by every model: their ledgers, their paced links, and
        # compute threads that may run concurrently (dropout seeds under the shared lock)
        self.shared = SharedDevices(
            list(self.backends.values()),
            LinkPacer(sched.graph.links),
            len(sched.graph.in_order_lanes()) > 1,
        )
        self.left = Counter((m, s) for m, s, _ in sched.origin)
        self.running: dict[tuple[int, int], object] = {}
        self.done: dict[tuple[int, int], object] = {}
        self.lock = threading.Lock()
        self.rng_lock = threading.Lock()  # every model seeds torch's one CPU generator

    def run(self) -> MultiRun:

        for m, engine in enumerate(self.engines):
            engine.host.make_replicas({p.gpu for p in self.sched.placements if p.job == m} - {0})
        # the server's memory taken in the order the simulator played the merged graph
        admission = MemoryOrder(
            self.sched.graph,
            play(self.sched.graph).order,
            {name: b.ledger for name, b in self.backends.items()},
        )
        executor = Executor(self.sched.graph, self._task, admission)
        t0 = time.perf_counter()
        for b in self.backends.values():
            b.ledger.reset(t0)
        try:
            wall = executor.run(t0)
        except BaseException:
            for run in self.running.values():
                run.roll_back()
            raise
        losses = [
            [self.done[(m, s)].loss for s in range(len(data))]
            for m, data in enumerate(self.batches)
        ]
        return MultiRun(self.sched, self._trace(executor, wall), losses)

    def _step(self, m: int, s: int):

        with self.lock:
            run = self.running.get((m, s))
            if run is None:
                x, y = self.batches[m][s]
                # slots follow the engine's own graph: here, buffers for the whole model
                context = replace(
                    self.engines[m].step_context(), gradient_slots=None, rng_lock=self.rng_lock
                )
                run = StepRun(context, self.sched.views[(m, s)], as_args(x), y, self.shared)
                self.running[(m, s)] = run
            return run

    def _task(self, task: Task) -> None:
        m, s, i = self.sched.origin[task.id]
        run = self._step(m, s)
        run.run_task(run.graph.tasks[i])
        with self.lock:
            self.left[(m, s)] -= 1
            if self.left[(m, s)] == 0:
                self.engines[m].run_state.step_count += 1
                self.done[(m, s)] = self.running.pop((m, s))
                self.done[(m, s)].close()

    def _trace(self, executor, wall: float) -> Trace:
        moved = [self.done[(m, s)].moved_task.get(i, 0.0) for m, s, i in self.sched.origin]
        return Trace.from_run(
            self.sched.graph,
            executor.start,
            executor.end,
            moved,
            {name: b.ledger.peak for name, b in self.backends.items()},
            {name: list(b.ledger.history) for name, b in self.backends.items()},
            capacity={name: float(b.ledger.capacity) for name, b in self.backends.items()},
            iteration_s=wall,
            executor="engine",
            **memory_checks(self.backends.values()),
        )
