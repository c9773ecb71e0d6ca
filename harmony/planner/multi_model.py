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
packs give one unit per pack pass; harmony-no-grouping one per pack and microbatch.
In the merged schedule a model's next unit may run on another GPU, so its plan
runs with ``offload_activations``: a unit takes its inputs from host memory and
leaves its outputs there (HYDRA's spilling), and every buffer a unit allocates
is freed by the unit's own tasks.

**One graph.** A schedule becomes one :class:`~harmony.graph.TaskGraph`, which
:func:`~harmony.simulate.simulate_graph` plays (one Trace; its ``model`` column
is the job) and the engine runs (:func:`harmony.engine.train_many.train_many`). Each unit's
tasks move to its GPU (lanes ``gpu0.*`` -> ``gpuK.*``, with their links and buffers); the CPU
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

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import pandas as pd

from ..costs.hardware import Hardware
from ..errors import HarmonyError, OutOfMemoryError
from ..graph import IN_ORDER_KINDS
from ..plan import Plan
from ..policies import build_graph
from ..simulate import simulate_graph
from ..trace import Trace
from .merge import Merger, MultiSchedule
from .units import Job, Placement, Solo, cut

SCHEDULES = ("sequential", "task-parallel", "merged")


# ---- the schedules ------------------------------------------------------------------
def _sequential(jobs: list[Job], solos: list[Solo], n_gpus: int) -> list[Placement]:
    out, t = [], 0.0
    for m, (job, solo) in enumerate(zip(jobs, solos)):
        for s in range(job.steps):
            for u, d in enumerate(solo.duration):
                out.append(Placement(m, s, u, solo.gpu[u], t, t + d))
                t += d
    return out


def _task_parallel(jobs: list[Job], solos: list[Solo], n_gpus: int) -> list[Placement]:
    free = [0.0] * n_gpus
    out = []
    for m in sorted(range(len(jobs)), key=lambda m: -jobs[m].steps * solos[m].iteration_s):
        k = min(range(n_gpus), key=free.__getitem__)
        for s in range(jobs[m].steps):
            for u, d in enumerate(solos[m].duration):
                out.append(Placement(m, s, u, k, free[k], free[k] + d))
                free[k] += d
    return sorted(out, key=lambda p: p.start_s)  # stable: each GPU's and each model's order stay


def _merged(jobs: list[Job], solos: list[Solo], n_gpus: int) -> list[Placement]:
    """HYDRA's heuristic: the GPU that frees first takes the next unit of the
    model with the longest remaining work among those ready by then (else of
    the model ready soonest)."""
    left = [job.steps * solo.iteration_s for job, solo in zip(jobs, solos)]
    placed = [0] * len(jobs)
    ready = [0.0] * len(jobs)
    free = [0.0] * n_gpus
    out = []
    while True:
        active = [
            m for m, job in enumerate(jobs) if placed[m] < job.steps * len(solos[m].duration)
        ]
        if not active:
            return sorted(out, key=lambda p: p.start_s)
        k = min(range(n_gpus), key=free.__getitem__)
        waiting = [m for m in active if ready[m] <= free[k]]
        m = (
            max(waiting, key=left.__getitem__)
            if waiting
            else min(active, key=lambda m: (ready[m], -left[m]))
        )
        s, u = divmod(placed[m], len(solos[m].duration))
        d = solos[m].duration[u]
        begin = max(free[k], ready[m])
        out.append(Placement(m, s, u, k, begin, begin + d))
        free[k] = ready[m] = begin + d
        left[m] -= d
        placed[m] += 1


_PLACERS: dict[str, Callable] = {
    "sequential": _sequential,
    "task-parallel": _task_parallel,
    "merged": _merged,
}


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
        raise HarmonyError(
            f"hardware must be a harmony.Hardware (e.g. harmony.preset('paper-4x1080ti')), "
            f"got {type(hardware).__name__}"
        )
    jobs = list(jobs)
    if not jobs:
        raise HarmonyError(
            "no jobs: give a list of harmony.Job(spec, plan, steps), one per model to train"
        )
    for i, job in enumerate(jobs):
        if not isinstance(job, Job):
            raise HarmonyError(
                f"jobs[{i}] is a {type(job).__name__}, not a harmony.Job(spec, plan, steps)"
            )
        if schedule != "sequential" and job.plan.n_gpus != 1:
            raise HarmonyError(
                f"job {job.label!r}: the {schedule} schedule runs each model on one GPU at a "
                f"time, but its plan is for {job.plan.n_gpus} GPUs ({hardware.name!r} has "
                f"{hardware.n_gpus}); give it a 1-GPU plan (a plan over several GPUs goes in "
                "parallel_plan, for the sequential schedule)"
            )
    return jobs


def schedule_many(
    jobs: Sequence[Job], hardware: Hardware, schedule: str = "merged"
) -> MultiSchedule:
    """Place every job's units on ``hardware``'s GPUs by ``schedule`` (one of
    :data:`SCHEDULES`) and build the one task graph that runs them all."""
    jobs = _check(jobs, hardware, schedule)
    solos = []
    for m, job in enumerate(jobs):
        plan = _plan_for(job, schedule)
        solo = cut(build_graph(job.spec, hardware, plan, model=m), plan)
        if solo.peak > hardware.gpu_memory:
            raise OutOfMemoryError(
                f"job {job.label!r}: its plan alone needs {solo.peak / 1e6:.1f} MB on a GPU, more "
                f"than the {hardware.gpu_memory / 1e6:.1f} MB of {hardware.name!r}; pick a plan "
                "that fits (harmony.search)"
            )
        solos.append(solo)
    placements = _PLACERS[schedule](jobs, solos, hardware.n_gpus)
    merger = Merger(schedule, jobs, solos, placements, hardware)
    return MultiSchedule(
        schedule, jobs, hardware, merger.graph, placements, merger.origin, merger.views
    )


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
        return pd.Series(
            {job.label: ends.get(m, float("nan")) for m, job in enumerate(self.schedule.jobs)},
            name="finish_s",
        )

    def row(self) -> dict:
        """The run in one table row (see :func:`compare_schedules`)."""
        tl, s = self.trace.timeline, self.trace.summary
        gpus = len(self.schedule.graph.memory_capacity)
        compute = tl[tl.kind.isin(sorted(IN_ORDER_KINDS))]
        return {
            "schedule": self.schedule.schedule,
            "models": len(self.schedule.jobs),
            "gpus": gpus,
            "total_s": self.total_s,
            "samples_per_s": s.samples_per_s,
            "gpu_busy": float((compute.end_s - compute.start_s).sum()) / (gpus * self.total_s),
            "swap_gb": s.swap_bytes / 1e9,
            "peak_gb": max(s.peak_memory.values(), default=0.0) / 1e9,
            "fits": s.fits,
        }


def simulate_many(jobs: Sequence[Job], hardware: Hardware, schedule: str = "merged") -> MultiRun:
    """Simulate training every job (its ``steps`` iterations) together on ``hardware``."""
    sched = schedule_many(jobs, hardware, schedule)
    return MultiRun(sched, simulate_graph(sched.graph))


def compare_schedules(
    jobs: Sequence[Job], hardware: Hardware, schedules: Sequence[str] = SCHEDULES
) -> pd.DataFrame:
    """Simulated time to train every job under each schedule, one row per schedule;
    ``over_merged``: its time over the merged schedule's."""
    df = pd.DataFrame([simulate_many(jobs, hardware, name).row() for name in schedules])
    if "merged" in list(schedules):
        df["over_merged"] = df.total_s / df.loc[df.schedule == "merged", "total_s"].iloc[0]
    df.attrs.update(hardware=hardware.name, models=[job.label for job in jobs])
    return df


# ---- for real, on an emulated server -------------------------------------------------------
