"""Harmony-PP (VLDB 2022): pipeline placement of layer packs over GPUs.

Each forward pack, the fused last pack and each backward pack runs *grouped*:
over every microbatch of the minibatch while its weights are resident, so the
weights cross the link once per pass whatever the number of microbatches.
Packs go round-robin over the GPUs in task order; activations and their
gradients flow GPU->GPU. Each pack's gradient leaves the GPU once, and its
CPU update starts as soon as it lands, overlapping the rest of backward.
"""

from __future__ import annotations

from ..graph import TaskGraph
from ..hardware import Hardware
from ..plan import Plan
from ..spec import ModelSpec
from .builder import GraphBuilder
from .common import (boundary_bytes, data_bytes, grouped_ops, pack_weight_bytes,
                     stash_bytes)

NAME = "harmony-pp"


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(spec, hw, plan, model)
    n = plan.n_gpus
    # Consecutive steps share a GPU only when there is one GPU.
    offload = plan.option("offload_activations") and n == 1
    steps = grouped_ops(plan, (0, plan.minibatch), lambda i: i % n, lambda i: offload)
    b.run([op for step in steps for op in step])
    for group in b.bwd_groups:
        out = b.grad_out(group)
        b.update(group.pack, group.layers, [out.id], worker=group.pack)
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan) -> dict[str, float]:
    B = plan.minibatch
    stash_out, stash_in = stash_bytes(spec, plan, B)
    moved = boundary_bytes(spec, plan, B)
    offload = plan.option("offload_activations") and plan.n_gpus == 1
    return {
        "W_IN": pack_weight_bytes(spec, plan),
        "G_OUT": spec.grad_bytes(),
        "STASH_OUT": stash_out,
        "STASH_IN": stash_in,
        "DATA_IN": data_bytes(spec, B),
        "P2P": moved if plan.n_gpus > 1 else 0.0,
        "ACT_OUT": moved if offload else 0.0,
        "ACT_IN": moved if offload else 0.0,
        "REDUCE": 0.0,
    }
