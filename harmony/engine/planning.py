"""``plan="auto"``: profile the chain on the engine's device, then search."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import HarmonyError
from ..plan import Plan
from ..planner.search import search
from .describe import microbatch_dependence
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
    # the whole device: the engine takes memory exactly as the simulator plays it
    hw = engine.hardware()
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
    for plan in df["plan"]:  # fastest first
        try:  # e.g. tied weights inside one data-parallel pack: a plan the engine refuses
            engine._params_per_update(plan)
        except HarmonyError:
            continue
        return plan
    raise HarmonyError(
        f"plan='auto' found no plan this engine can run on {engine.backend.kind}: every plan "
        "that fits puts tied weights inside one data-parallel pack; use one GPU or harmony-pp"
    )
