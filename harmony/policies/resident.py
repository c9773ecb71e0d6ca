"""Resident: the whole training state on the GPU, as a plain PyTorch loop keeps it.

When the model, its gradients, its optimizer state and a minibatch's
activations fit on one GPU, swapping anything costs time for nothing: the
plain loop (``model.cuda()``, the optimizer stepping on the GPU) is the
fastest schedule. This policy is that loop in the IR, so that the search can
weigh it against Harmony's placements by simulation like any other plan, and
the simulator's memory ledger says where it does not fit.

The plan: one GPU, one backward pack holding every layer (no forward packs),
so that each microbatch runs forward and backward through the whole model
(a fused FWDBWD) and autograd sums the microbatches' gradients as the plain
loop does. The weights are loaded once per step (a W_IN that moves nothing:
they are already there; under mixed precision the engine casts the master
weights to the compute dtype on the GPU), the gradient sum is handed to the
update without leaving the GPU (a G_OUT that moves nothing), and the
optimizer steps on the GPU's compute lane. The master weights (under mixed
precision, with float32 gradients) and the optimizer state are a buffer held
across the whole step: charged to the GPU, with the weights and gradients in
the compute dtype, at the step's peak.

Simplified: the update streams its bytes at
:attr:`~harmony.costs.hardware.Hardware.gpu_update_bandwidth` (measured on the
device by the engine's calibration); nothing of the state goes to a disk
tier (a plan whose host copy would need one is refused with a
:class:`~harmony.costs.placement.HostMemoryError`, which the search counts as
not fitting the host).
"""

from __future__ import annotations

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import HostMemoryError, Placement
from ..costs.spec import ModelSpec, dtype_bytes, state_slots
from ..errors import HarmonyError
from ..graph import G_OUT, W_IN, TaskGraph
from ..plan import Plan
from .builder import GraphBuilder
from .common import grouped_ops, volume
from .state import stepped_numel
from .swapping import gpu_update_seconds

NAME = "resident"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (one candidate per microbatch size, simulated like the rest)
SEARCHED = True
PER_MICROBATCH = False
#: weights, gradients and optimizer state stay on the GPU from step to step (the engine's
#: harmony.engine.step.resident runs it so)
STATE_ON_GPU = True


def plan_for(num_layers: int, minibatch: int, microbatch: int, **options) -> Plan:
    """The resident plan of a ``num_layers`` chain: one pack, microbatches of ``microbatch``."""
    return Plan(NAME, 1, minibatch, microbatch, microbatch, (), ((0, num_layers),), dict(options))


def check(plan: Plan, num_layers: int) -> None:
    """Refuse a plan this policy cannot run, saying how to write one."""
    whole = ((0, num_layers),)
    if plan.n_gpus != 1 or plan.fwd_packs or tuple(plan.bwd_packs) != whole:
        raise HarmonyError(
            f"a {NAME} plan runs one GPU and one backward pack of every layer, no forward "
            f"packs (harmony.policies.resident.plan_for(num_layers, minibatch, microbatch)); "
            f"got {plan.describe()}"
        )
    if plan.fwd_microbatch != plan.bwd_microbatch:
        raise HarmonyError(f"a {NAME} plan has one microbatch size; got {plan.describe()}")


def state_bytes(spec: ModelSpec) -> float:
    """Bytes the GPU holds beyond the weights and gradients in the compute dtype: the
    optimizer's float32 slots and, under mixed precision, float32 master weights
    and gradients."""
    n = stepped_numel(spec, 0, len(spec))
    master = 4 if spec.master_dtype and dtype_bytes(spec.param_dtype) != 4 else 0
    return float(n * (2 * master + 4 * state_slots(spec.optimizer)))


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    check(plan, len(spec))
    b = GraphBuilder(spec, hw, plan, model)
    steps = grouped_ops(plan, (0, plan.minibatch), lambda i: 0, lambda i: False)
    b.run([op for step in steps for op in step])
    (group,) = b.bwd_groups
    out = b.grad_out(group)
    step = b.update(group.pack, group.layers, [out.id], worker=0)
    load = next(t for t in b.tasks if t.kind == W_IN)
    for t in (load, out):  # already on the GPU: nothing crosses a link
        t.nbytes, t.what = 0.0, f"{t.what} (resident)"
    state = b.buffer("gpu0", state_bytes(spec), "optimizer state and master weights (resident)")
    load.allocs.append(state)
    load.io["state"] = state
    b.release(step, state)
    last = max(t.seq[0] for t in b.tasks)
    step.lane, step.device, step.seq = "gpu0.compute", "gpu0", (last + 1, 1, 0)
    step.duration = gpu_update_seconds(spec, group.layers, hw) + hw.task_overhead_s
    step.what = f"update {group.layers} on gpu0 (resident)"
    graph = b.graph(policy=NAME)
    if "disk" in graph.info:  # a HostMemoryError: the search and plan="auto" pass it by
        raise HostMemoryError(
            f"a {NAME} plan has no disk tier, and its host copy of the state needs one in "
            f"{format_bytes(hw.host_memory)} of host memory: give it more, or use a policy "
            "that places state on disk (harmony-pp)",
            available=float(hw.host_memory),
        )
    return graph


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    out = volume(spec, plan, weight_passes=0, grad_passes=0)
    out[W_IN] = out[G_OUT] = 0.0
    return out
