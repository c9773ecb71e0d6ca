"""``plan="auto"``: profile the chain on the engine's device, then search."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import HostMemoryError
from ..errors import HarmonyError
from ..plan import Plan
from ..planner.search import search
from .describe import microbatch_dependence
from .host_memory import besides_the_model
from .profiler import profile

if TYPE_CHECKING:
    from .engine import Engine


def auto_plan(engine: "Engine", inputs: tuple, target: torch.Tensor) -> Plan:
    """The fastest plan for ``engine``'s chain on its devices (across servers:
    rank 0's, which every server then runs)."""
    if engine.distributed and torch.distributed.get_rank() != 0:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        engine.profile = None
        return Plan.from_dict(box[0])
    plan = _search(engine, inputs, target)
    if engine.distributed:
        torch.distributed.broadcast_object_list([plan.to_dict()], src=0)
    return plan


def _search(engine: "Engine", inputs: tuple, target: torch.Tensor) -> Plan:
    if engine.profile is None or not engine.profile.has_times:
        engine.profile = profile(
            engine.layers,
            inputs,
            target,
            engine.loss_fn,
            engine._optimizer_factory,
            device=engine.backend.torch_device,
            name=engine.spec.name,
            safe_updates=engine.safe_updates,
            dtype=engine.compute_dtype,
        )
    # a disk tier's bandwidth is part of what the search weighs: measure it first
    engine.host_settings.measure_disk()
    budget, besides = engine.host_settings.budget.capacity, besides_the_model(engine.host_module)
    if budget <= besides:
        raise HostMemoryError(
            f"host memory: the budget of {format_bytes(budget)} is not more than this process "
            f"holds besides the model ({format_bytes(besides)}: the interpreter, torch, data): "
            "nothing is left for training state; give a larger host_memory= (--host-memory)"
        )
    # the whole device: the engine takes memory exactly as the simulator plays it
    hw = engine.hardware()
    short = None
    for _ in range(SEARCHES):
        try:
            ranked = _ranked(engine, hw)
        except HostMemoryError:
            if short is None:
                raise
            break  # what the engine's budget left was too little: said below, in full
        plan, short = _first_that_runs(engine, ranked)
        if plan is not None:
            return plan
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
        f"plan='auto' found no plan this engine can run on {engine.backend.kind}: every plan "
        "that fits puts tied weights inside one data-parallel pack; use one GPU or harmony-pp"
    )


#: searches ``plan="auto"`` runs at most, each with the host memory the last one's
#: fastest plan was left for its state
SEARCHES = 4


def _ranked(engine: "Engine", hw: Hardware) -> list[Plan]:
    """Plans for ``engine`` on ``hw``, fastest first."""
    try:
        n = len(engine.backends)
        policies = ("harmony-pp",) if n == 1 else ("harmony-pp", "harmony-dp")
        df = search(
            engine.profile,
            hw,
            engine.minibatch_size,
            policies=policies,
            n_gpus=n,
            workers=1,
            equal_microbatches=microbatch_dependence(engine.layers) is not None,
        )
    except HarmonyError as e:  # out of memory stays out of memory
        raise type(e)(
            f"plan='auto' found no plan for this model on {engine.backend.kind}: {e}"
        ) from None
    return list(df["plan"])


def _first_that_runs(
    engine: "Engine", plans: list[Plan]
) -> tuple[Plan | None, HostMemoryError | None]:
    """The first of ``plans`` the engine can run in its host memory; else None
    and why the fastest it could run otherwise did not fit (None: none it could
    run)."""
    short = None
    for plan in plans:
        try:  # e.g. tied weights inside one data-parallel pack: a plan the engine refuses
            engine._params_per_update(plan)
        except HarmonyError:
            continue
        try:  # kept by the engine for its first step
            engine.host_graph(plan, engine.host_settings)
        except HostMemoryError as e:
            short = short or e
            continue
        return plan, None
    return None, short
