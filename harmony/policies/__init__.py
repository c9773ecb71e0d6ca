"""Policies: one module per system; each turns (spec, hardware, plan) into a
TaskGraph and knows its closed-form swap volume. Nothing else knows which
system runs. :data:`POLICIES` is the one list of them; each module says its
``NAME``, its ``ROLE`` (Harmony's own, an ablation of it, or another system)
and whether the search plans it (``SEARCHED``). Policies build graphs only:
they neither simulate nor choose plans (that is :mod:`harmony.planner`).
Every graph is finished by the shared builder, which also places the training
state between host memory and a disk tier (:func:`disk_placement`)."""

from __future__ import annotations

import contextlib
from types import ModuleType

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..gc_pause import gc_paused
from ..graph import TaskGraph
from ..plan import Plan
from . import (
    gpipe_swap,
    harmony_dp,
    harmony_no_grouping,
    harmony_pp,
    hydra,
    karma,
    layer_swap,
    model_parallel,
    resident,
    zero_offload,
)
from .common import replica_shares
from .compute_time import busiest_gpu_seconds
from .swapping import OPTIONS as STATE_OPTIONS
from .tier_placement import place, stashes_in_flight  # noqa: F401  (the engine reads it here)

POLICIES: dict[str, ModuleType] = {
    m.NAME: m
    for m in (
        harmony_pp,
        harmony_dp,
        harmony_no_grouping,
        karma,
        hydra,
        zero_offload,
        gpipe_swap,
        layer_swap,
        model_parallel,
        resident,
    )
}
#: names policies had before, and why they changed
RENAMED = {
    "virtual-memory": (
        "policy 'virtual-memory' was renamed 'harmony-no-grouping': it is Harmony-DP without "
        "input-batch grouping (Harmony's planner, prefetch, CPU optimizer and recompute), an "
        "ablation, not GPU memory virtualized as vDNN, LMS or GPipe-with-swapping run it; for "
        "those use the faithful baselines 'layer-swap' (per-layer swapping, one GPU or data "
        "parallel), 'gpipe-swap', 'karma' and 'model-parallel' "
        "(harmony.planner.plan_for(policy, ...))"
    ),
}
#: policies that split each pack's CPU update into one shard per data-parallel GPU
SHARDED_UPDATES = (harmony_dp.NAME, zero_offload.NAME)


def names(role: str | None = None, searched: bool | None = None) -> list[str]:
    """The policies, in :data:`POLICIES` order, of ``role`` and ``searched`` (None: any)."""
    return [
        n
        for n, m in POLICIES.items()
        if (role is None or m.ROLE == role) and (searched is None or m.SEARCHED == searched)
    ]


def get_policy(name: str) -> ModuleType:
    try:
        return POLICIES[name]
    except KeyError:
        if name in RENAMED:
            raise HarmonyError(RENAMED[name]) from None
        raise HarmonyError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}"
        ) from None


def build_graph(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    if not isinstance(plan, Plan):
        raise HarmonyError(f"plan must be a harmony.Plan, got {type(plan).__name__}")
    policy = get_policy(plan.policy)
    plan.validate(len(spec))
    check_options(plan)
    with gc_paused():  # as a play is (harmony.gc_pause): the graph's objects make no cycles
        return policy.build(spec_for(spec, plan), hw, plan, model)


def compute_lower_bound(spec: ModelSpec, hw: Hardware, plan: Plan) -> float | None:
    """At most ``plan``'s simulated iteration time, without building its graph: the
    compute of its busiest GPU (:func:`.compute_time.busiest_gpu_seconds`). None for
    a policy that does not list its compute ops apart from its graph (``ops``)."""
    ops = getattr(get_policy(plan.policy), "ops", None)
    if ops is None:
        return None
    plan.validate(len(spec))
    check_options(plan)
    return busiest_gpu_seconds(spec_for(spec, plan), hw, ops(plan))


def swap_volume(spec: ModelSpec, plan: Plan, hardware: Hardware | None = None) -> dict[str, float]:
    """Bytes each kind of transfer moves in one iteration of ``plan``, in closed
    form; with ``hardware``, the disk tier's too (DISK_IN, DISK_OUT: none where
    the state fits its host memory; see :mod:`.disk_tier`)."""
    plan.validate(len(spec))
    check_options(plan)
    policy, spec = get_policy(plan.policy), spec_for(spec, plan)
    out = policy.swap_volume(spec, plan)
    if hardware is None:
        return out
    placement = place(spec, plan, hardware, out, *_disk_traits(plan))
    return policy.swap_volume(spec, plan, disk=placement) if placement.uses_disk else out


def disk_placement(spec: ModelSpec, hardware: Hardware, plan: Plan) -> Placement:
    """Where ``plan``'s training state lives on ``hardware``: in host memory, or
    on its disk tier (the placement :func:`build_graph` adds DISK_IN / DISK_OUT
    tasks for). A :class:`~harmony.costs.placement.HostMemoryError` when it does
    not fit."""
    plan.validate(len(spec))
    check_options(plan)
    spec = spec_for(spec, plan)
    moved = get_policy(plan.policy).swap_volume(spec, plan)
    return place(spec, plan, hardware, moved, *_disk_traits(plan))


def without_gradient_slots():
    """Within it, every policy holds the whole model's gradients in host memory
    (its ``GRADIENT_WINDOW`` off): to measure what gradient slots save."""
    return _without("GRADIENT_WINDOW")


def without_weights_with_update():
    """Within it, every weight load reads the master weights it needs from the
    disk tier for itself (the policies' ``WEIGHTS_WITH_UPDATE`` off): to measure
    what a backward load sharing its pack's update's read saves."""
    return _without("WEIGHTS_WITH_UPDATE")


@contextlib.contextmanager
def _without(trait: str):
    """Within it, every policy's ``trait`` is off."""
    saved = {name: getattr(m, trait, False) for name, m in POLICIES.items()}
    for m in POLICIES.values():
        setattr(m, trait, False)
    try:
        yield
    finally:
        for name, m in POLICIES.items():
            setattr(m, trait, saved[name])


def state_on_gpu(policy: str) -> bool:
    """Whether ``policy`` keeps the whole training state (weights, gradients, optimizer
    state) on its GPU from step to step, moving none of it (its ``STATE_ON_GPU``)."""
    return getattr(get_policy(policy), "STATE_ON_GPU", False)


def gradient_window(policy: str) -> bool:
    """Whether ``policy`` sends its packs' gradients pack after pack, so that
    they can be held in slots (its ``GRADIENT_WINDOW``)."""
    return getattr(get_policy(policy), "GRADIENT_WINDOW", False)


def _disk_traits(plan: Plan) -> tuple[bool, bool]:
    """What :func:`.tier_placement.place` needs of ``plan``'s policy: its ``GRADIENT_WINDOW``
    and its ``WEIGHTS_WITH_UPDATE``."""
    policy = get_policy(plan.policy)
    return gradient_window(plan.policy), getattr(policy, "WEIGHTS_WITH_UPDATE", False)


def spec_for(spec: ModelSpec, plan: Plan) -> ModelSpec:
    """``spec`` in the precision ``plan`` runs in (its option ``precision``; None: the spec's)."""
    precision = plan.option("precision")
    return spec if precision is None else spec.in_precision(precision)


def check_options(plan: Plan) -> None:
    """Refuse an option that keeps training state on the GPU (``gpu_optimizer``,
    ``gpu_gradients``) for a policy that does not read it (its ``OPTIONS``)."""
    reads = getattr(get_policy(plan.policy), "OPTIONS", ())
    unread = [k for k, v in plan.options if k in STATE_OPTIONS and k not in reads and v]
    if unread:
        users = [n for n, m in POLICIES.items() if set(unread) <= set(getattr(m, "OPTIONS", ()))]
        raise HarmonyError(
            f"{plan.policy} keeps gradient sums and the optimizer on the host: "
            f"option(s) {', '.join(unread)} apply to {', '.join(users)}"
        )


def update_shards(plan: Plan) -> int:
    """How many shards each backward pack's CPU update is split into: one per
    GPU with samples for policies that partition the update, else one (the
    state options of the baselines keep one optimizer per pack: every GPU that
    runs the pack steps it whole)."""
    if plan.policy not in SHARDED_UPDATES:
        return 1
    return sum(1 for a, b in replica_shares(plan.minibatch, plan.n_gpus) if b > a)
