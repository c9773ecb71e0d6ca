"""``plan="auto"``: profile the chain on the engine's device, then search."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import HostMemoryError
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..plan import Plan
from ..planner.search import search
from .describe import microbatch_dependence
from .disk_setup import HostSettings
from .host_memory import besides_the_model
from .profiler import profile


@dataclass
class Searched:
    """What ``plan="auto"`` searches for: a chain of ``layers`` with its loss and
    optimizer factory, on ``backends`` (the engine's devices), trained in
    minibatches of ``minibatch_size`` in ``dtype`` (None: float32), across
    servers if ``distributed``. ``spec``: the chain's sizes; ``profile``: its
    measured times, if any. ``hardware()``: the server as the planner sees it;
    ``params_per_update(plan)``: refuses a plan the engine cannot run;
    ``host_graph(plan, profile)``: the plan's graph for the host memory,
    :class:`HostMemoryError` if it cannot fit."""

    layers: list[nn.Module]
    loss_fn: Callable
    optimizer: Callable
    backends: list
    minibatch_size: int
    dtype: torch.dtype | None
    safe_updates: bool
    distributed: bool
    spec: ModelSpec
    profile: ModelSpec | None
    host_settings: HostSettings
    host_module: nn.Module
    hardware: Callable[[], Hardware]
    params_per_update: Callable[[Plan], dict]
    host_graph: Callable[[Plan, ModelSpec], tuple]


def auto_plan(job: Searched, inputs: tuple, target: torch.Tensor) -> tuple[Plan, ModelSpec | None]:
    """The fastest plan for ``job``'s chain on its devices (across servers: rank 0's,
    which every server then runs), and the profile it was searched with (None on
    the other servers)."""
    if job.distributed and torch.distributed.get_rank() != 0:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        return Plan.from_dict(box[0]), None
    plan, measured = _search(job, inputs, target)
    if job.distributed:
        torch.distributed.broadcast_object_list([plan.to_dict()], src=0)
    return plan, measured


def _search(job: Searched, inputs: tuple, target: torch.Tensor) -> tuple[Plan, ModelSpec]:
    measured = job.profile
    if measured is None or not measured.has_times:
        measured = profile(
            job.layers,
            inputs,
            target,
            job.loss_fn,
            job.optimizer,
            device=job.backends[0].torch_device,
            name=job.spec.name,
            safe_updates=job.safe_updates,
            dtype=job.dtype,
            described=job.spec,
        )
    # a disk tier's bandwidth is part of what the search weighs: measure it first
    job.host_settings.measure_disk()
    budget, besides = job.host_settings.budget.capacity, besides_the_model(job.host_module)
    if budget <= besides:
        raise HostMemoryError(
            f"host memory: the budget of {format_bytes(budget)} is not more than this process "
            f"holds besides the model ({format_bytes(besides)}: the interpreter, torch, data): "
            "nothing is left for training state; give a larger host_memory= (--host-memory)"
        )
    # the whole device: the engine takes memory exactly as the simulator plays it
    hw = job.hardware()
    short = None
    for _ in range(SEARCHES):
        try:
            ranked = _ranked(job, measured, hw)
        except HostMemoryError:
            if short is None:
                raise
            break  # what the engine's budget left was too little: said below, in full
        plan, short = _first_that_runs(job, measured, ranked)
        if plan is not None:
            return plan, measured
        if short is None or short.available is None or short.available >= hw.host_memory:
            break
        # the search saw host memory less the process; the devices (an emulated GPU's
        # buffers, the cpu backend's computations), the tier's I/O buffers and the
        # update journal take some too: search again with what the fastest plan's
        # placement was left of it
        hw = hw.with_host_memory(int(short.available))
    if short is not None:
        raise HostMemoryError(
            f"plan='auto' found no plan that fits this engine's host memory: {short}"
        ) from None
    raise HarmonyError(
        f"plan='auto' found no plan this engine can run on {job.backends[0].kind}: every plan "
        "that fits puts tied weights inside one data-parallel pack; use one GPU or harmony-pp"
    )


#: searches ``plan="auto"`` runs at most, each with the host memory the last one's
#: fastest plan was left for its state
SEARCHES = 4


def _ranked(job: Searched, measured: ModelSpec, hw: Hardware) -> list[Plan]:
    """Plans for ``job``'s chain (``measured``) on ``hw``, fastest first."""
    try:
        n = len(job.backends)
        # one GPU: the plain loop with everything on it too, where it fits
        policies = ("harmony-pp", "resident") if n == 1 else ("harmony-pp", "harmony-dp")
        df = search(
            measured,
            hw,
            job.minibatch_size,
            policies=policies,
            n_gpus=n,
            workers=1,
            equal_microbatches=microbatch_dependence(job.layers) is not None,
        )
    except HarmonyError as e:  # out of memory stays out of memory
        raise type(e)(
            f"plan='auto' found no plan for this model on {job.backends[0].kind}: {e}"
        ) from None
    return list(df["plan"])


def _first_that_runs(
    job: Searched, measured: ModelSpec, plans: list[Plan]
) -> tuple[Plan | None, HostMemoryError | None]:
    """The first of ``plans`` the engine can run in its host memory; else None
    and why the fastest it could run otherwise did not fit (None: none it could
    run)."""
    short = None
    for plan in plans:
        try:  # e.g. tied weights inside one data-parallel pack: a plan the engine refuses
            job.params_per_update(plan)
        except HarmonyError:
            continue
        try:  # kept by the engine for its first step
            job.host_graph(plan, measured)
        except HostMemoryError as e:
            short = short or e
            continue
        return plan, None
    return None, short
