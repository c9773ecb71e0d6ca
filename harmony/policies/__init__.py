"""Policies: one module per system; each turns (spec, hardware, plan) into a
TaskGraph and knows its closed-form swap volume. Nothing else knows which
system runs. :data:`POLICIES` is the one list of them; each module says its
``NAME``, its ``ROLE`` (Harmony's own, an ablation of it, or another system)
and whether the search plans it (``SEARCHED``). Policies build graphs only:
they neither simulate nor choose plans (that is :mod:`harmony.planner`)."""

from __future__ import annotations

from types import ModuleType

from ..errors import HarmonyError
from ..graph import TaskGraph
from ..costs.hardware import Hardware
from ..plan import Plan
from ..costs.spec import ModelSpec
from . import gpipe_swap, harmony_dp, harmony_pp, hydra, karma, virtual_memory, zero_offload
from .common import replica_shares

POLICIES: dict[str, ModuleType] = {m.NAME: m for m in (harmony_pp, harmony_dp, virtual_memory, karma, hydra,
                                                       zero_offload, gpipe_swap)}
#: policies that split each pack's CPU update into one shard per data-parallel GPU
SHARDED_UPDATES = (harmony_dp.NAME, zero_offload.NAME)


def names(role: str | None = None, searched: bool | None = None) -> list[str]:
    """The policies, in :data:`POLICIES` order, of ``role`` and ``searched`` (None: any)."""
    return [n for n, m in POLICIES.items()
            if (role is None or m.ROLE == role) and (searched is None or m.SEARCHED == searched)]


def get_policy(name: str) -> ModuleType:
    try:
        return POLICIES[name]
    except KeyError:
        raise HarmonyError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


def build_graph(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    if not isinstance(plan, Plan):
        raise HarmonyError(f"plan must be a harmony.Plan, got {type(plan).__name__}")
    policy = get_policy(plan.policy)
    plan.validate(len(spec))
    return policy.build(spec, hw, plan, model)


def swap_volume(spec: ModelSpec, plan: Plan) -> dict[str, float]:
    """Bytes each kind of transfer moves in one iteration of ``plan``, in closed form."""
    plan.validate(len(spec))
    return get_policy(plan.policy).swap_volume(spec, plan)


def update_shards(plan: Plan) -> int:
    """How many shards each backward pack's CPU update is split into: one per
    GPU with samples for policies that partition the update, else one."""
    if plan.policy not in SHARDED_UPDATES:
        return 1
    return sum(1 for a, b in replica_shares(plan.minibatch, plan.n_gpus) if b > a)
