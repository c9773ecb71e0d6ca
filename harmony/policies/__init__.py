"""One module per system; each turns (spec, hardware, plan) into a TaskGraph
and knows its closed-form swap volume. Nothing else knows which system runs."""

from __future__ import annotations

from types import ModuleType

from ..errors import HarmonyError
from ..graph import TaskGraph
from ..hardware import Hardware
from ..plan import Plan
from ..spec import ModelSpec
from . import harmony_dp, harmony_pp, virtual_memory

POLICIES: dict[str, ModuleType] = {m.NAME: m for m in (harmony_pp, harmony_dp, virtual_memory)}


def get_policy(name: str) -> ModuleType:
    try:
        return POLICIES[name]
    except KeyError:
        raise HarmonyError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


def build_graph(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    return get_policy(plan.policy).build(spec, hw, plan, model)


def swap_volume(spec: ModelSpec, plan: Plan) -> dict[str, float]:
    """Bytes each kind of transfer moves in one iteration of ``plan``, in closed form."""
    plan.validate(len(spec))
    return get_policy(plan.policy).swap_volume(spec, plan)
