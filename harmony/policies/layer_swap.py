"""Per-layer swapping: GPU memory virtualized one layer at a time (vDNN / LMS style).

The published systems: vDNN (Rhu et al., MICRO 2016) runs a network layer by
layer, offloads each layer's input feature maps to host memory during
forward and prefetches them back for the layer's backward; IBM's Large Model
Support (LMS, for TensorFlow and PyTorch) swaps any tensor, weights included,
between GPU and host memory as memory runs short, so a model larger than the
GPU trains as it would on a GPU with more memory; SwapAdvisor (Huang et al.,
ASPLOS 2020) plans such swaps ahead. With gradient accumulation, a framework
run this way goes through each microbatch on its own, keeps each gradient
sum on the (virtual) GPU and steps the optimizer there. The Harmony paper's
baselines are such swapping over one GPU, data parallel over several
(this policy) or pipelined (:mod:`.gpipe_swap`).

This policy: each microbatch goes through the model on its own, one pack at
a time; a pack's weights are swapped in for its forward and again for its
backward, on every microbatch; its input is swapped out in forward and back
in before backward, where the pack is recomputed from it; the next pack's
weights (and input) load while the current one computes (``prefetch_packs``
2), or only once it is done (1: on demand, no overlap of a load with
compute). Gradients and the update are as :mod:`.swapping` says: each
microbatch's gradient goes out, summed on the GPU (``gpu_gradients``: the
accumulator swapped back in for every microbatch) or on the host, and the
optimizer steps on the GPU (``gpu_optimizer``: its state swapped in and out)
or on the CPU. Over N GPUs it is data parallel: each GPU takes its share of
the minibatch, and the GPUs share the host links of their PCIe switch.

:func:`~harmony.planner.systems.choose_layer_swap` makes the faithful plan:
one layer per pack, optimizer and gradient sums on the GPU, and the largest
microbatch that fits. Activations are swapped (every layer's input goes to
host memory) or recomputed (checkpoints every few layers: the backward packs
are segments, each rebuilt from its first input) as its ``activations`` says.

Simplified: swapping follows a fixed schedule, not memory pressure; what a
layer's backward needs beyond its input is rebuilt from that input (the IR's
recompute), where vDNN keeps the few layers that need their output and LMS
swaps every saved tensor; the recompute waits for the output gradient, as
autograd would reach it.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from .builder import GraphBuilder
from .common import (
    check_one_microbatch_size,
    data_parallel_microbatch_ops,
    offloaded_bytes,
    replica_microbatches,
    replica_shares,
    volume,
)
from .swapping import OPTIONS as SWAPPING_OPTIONS
from .swapping import finish, state_volume

NAME = "layer-swap"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
#: each microbatch goes through the whole model on its own (one microbatch size, weights per
#: microbatch)
PER_MICROBATCH = True
#: plan options it reads beyond every policy's
OPTIONS = SWAPPING_OPTIONS


def _replicas(plan: Plan) -> list[int]:
    """The GPUs with samples: replica r runs on GPU r."""
    return [r for r, (a, b) in enumerate(replica_shares(plan.minibatch, plan.n_gpus)) if b > a]


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(spec, hw, plan, model, overlap_recompute=False)
    b.run(data_parallel_microbatch_ops(plan))
    finish(b, {q: _replicas(plan) for q in range(len(plan.bwd_packs))})
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    check_one_microbatch_size(plan)
    counts = [len(mbs) for mbs in replica_microbatches(plan)]
    n_mb = sum(counts)
    out = volume(
        spec,
        plan,
        weight_passes=n_mb,
        grad_passes=n_mb,
        via_host=offloaded_bytes(spec, plan),
        disk=disk,
    )
    out.update(state_volume(spec, plan, {q: counts for q in range(len(plan.bwd_packs))}))
    return out
