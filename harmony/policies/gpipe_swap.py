"""GPipe with swapping: the multi-GPU virtualized-memory baseline.

The published system, GPipe (Huang et al., NeurIPS 2019), cuts a model into
contiguous stages, one per GPU, and splits the minibatch into microbatches
that flow through the stages: every microbatch forward, then every
microbatch backward, each stage keeping only its input per microbatch and
recomputing the rest (re-materialization); gradients accumulate over the
microbatches for one synchronous update. When a stage does not fit in its
GPU, virtualized GPU memory (swapping, as IBM LMS does) keeps it running:
the stage's layers are swapped in and out for every microbatch. Harmony's
paper compares against this baseline (up to 7.6x for Harmony over baselines
that virtualize GPU memory).

This policy reproduces: stages of contiguous backward packs, as even a number
of packs per GPU as possible (:func:`stages`), forward packs on the stage of
their first layer; the GPipe
flow: each microbatch forward through all stages, the last stage fusing
forward, loss and backward as each microbatch arrives, then each microbatch
backward through the stages; inside a stage every pack's weights are swapped
in for every microbatch, forward and backward (prefetched, double buffered);
activations and their gradients go GPU to GPU between stages and stay on the
GPU inside one (or go through host memory with ``offload_activations``);
stashed pack inputs go to host memory; a microbatch's re-materialization
(recompute) waits for its output gradient (no ``overlap_recompute``), as GPipe
re-materializes in the backward pass; every microbatch's gradient goes to
host memory. The gradient sums and the optimizer are where the plan options
say (:mod:`.swapping`): on the host, each pack's CPU update starting once all
of its gradients are in (the defaults), or on the stage's GPU as a framework
with virtualized memory keeps them (``gpu_gradients``: the pack's accumulator
swapped back in for every microbatch; ``gpu_optimizer``: once the pipeline
has drained, each stage steps its packs on its GPU, their state swapped in
and out). The stages share the host links of their PCIe switch.
:func:`~harmony.planner.systems.choose_gpipe_swap` makes the faithful plan:
packs of one layer (every layer's input swapped) or checkpoint segments,
optimizer and gradient sums on the GPUs, the largest microbatch that fits.

Simplified: swapping follows the schedule pack by pack instead of reacting to
memory pressure; GPipe's stage inputs are stashed to host memory instead of
kept on the GPU; stages hold as even a number of packs as possible, where
GPipe balances them by cost; backward takes the microbatches in forward order
(GPipe reverses them), so gradients add up in the order of a plain loop.
"""

from __future__ import annotations

import bisect

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import FWD, TaskGraph
from ..plan import Plan
from .builder import GraphBuilder
from .common import (
    boundary_bytes,
    check_one_microbatch_size,
    microbatch_ops,
    microbatches,
    pack_sequence,
    replica_shares,
    volume,
)
from .swapping import OPTIONS as SWAPPING_OPTIONS
from .swapping import finish, state_volume

NAME = "gpipe-swap"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
PER_MICROBATCH = True
#: plan options it reads beyond every policy's
OPTIONS = SWAPPING_OPTIONS


def stages(plan: Plan) -> list[int]:
    """The GPU (stage) of each backward pack: contiguous runs of packs, as even
    in number as possible, the first stages taking one more."""
    P, n = len(plan.bwd_packs), plan.n_gpus
    if P < n:
        raise HarmonyError(
            f"gpipe-swap runs one stage of whole backward packs per GPU: {P} backward packs "
            f"cannot fill {n} stages; use at least {n} packs or fewer GPUs"
        )
    return [s for s, (a, b) in enumerate(replica_shares(P, n)) for _ in range(a, b)]


def _placement(plan: Plan) -> tuple[list[int], set[int], set[int]]:
    """The GPU of each step of :func:`~.common.pack_sequence`, and the steps whose
    output crosses to another GPU and those whose output goes through host memory."""
    check_one_microbatch_size(plan)
    stage = stages(plan)
    starts = [a for a, _ in plan.bwd_packs]
    gpu = [
        stage[bisect.bisect_right(starts, plan.fwd_packs[p][0]) - 1 if kind == FWD else p]
        for kind, p in pack_sequence(plan)
    ]
    cross = {i for i in range(len(gpu) - 1) if gpu[i] != gpu[i + 1]}
    via_host = (
        set() if not plan.option("offload_activations") else set(range(len(gpu) - 1)) - cross
    )
    return gpu, cross, via_host


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(spec, hw, plan, model, overlap_recompute=False)
    gpu, _, via_host = _placement(plan)
    mbs = microbatches((0, plan.minibatch), plan.fwd_microbatch)
    forward = range(len(plan.fwd_packs) + 1)  # forward packs, then the fused last pack
    backward = range(forward.stop, len(gpu))
    b.run(
        [
            op
            for phase in (forward, backward)
            for m, mb in enumerate(mbs)
            for op in microbatch_ops(plan, mb, m, gpu.__getitem__, via_host.__contains__, phase)
        ]
    )
    stage = stages(plan)
    finish(b, {q: [stage[q]] for q in range(len(plan.bwd_packs))})
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    _, cross, via_host = _placement(plan)
    B = plan.minibatch
    n_mb = len(microbatches((0, B), plan.fwd_microbatch))
    out = volume(
        spec,
        plan,
        weight_passes=n_mb,
        grad_passes=n_mb,
        p2p=boundary_bytes(spec, plan, B, cross),
        via_host=boundary_bytes(spec, plan, B, via_host),
        disk=disk,
    )
    out.update(state_volume(spec, plan, {q: [n_mb] for q in range(len(plan.bwd_packs))}))
    return out
