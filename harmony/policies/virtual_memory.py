"""The paper's baseline: GPU memory virtualized by swapping (LMS / vDNN style).

Each microbatch goes through the whole model on its own: every pack's weights
are swapped in for its forward and again for its backward, *on every
microbatch*, activations at backward-pack boundaries are swapped out and
back, and each pack's gradient goes to the host after every microbatch (the
host accumulates; the accumulation itself is not charged). Over N GPUs it is
data parallel: each GPU does this on its share of the minibatch. Prefetch
(double buffering) is the same as Harmony's, so the difference measured is
input-batch grouping. Packs of one layer give the classic per-layer swapping.
"""

from __future__ import annotations

from ..errors import HarmonyError
from ..graph import FWD, TaskGraph
from ..hardware import Hardware
from ..plan import Plan
from ..spec import ModelSpec
from .builder import GraphBuilder, Op
from .common import (boundary_bytes, data_bytes, microbatches, pack_sequence, pack_weight_bytes,
                     replica_shares, stash_bytes)

NAME = "virtual-memory"


def _check(plan: Plan) -> None:
    if plan.fwd_microbatch != plan.bwd_microbatch:
        raise HarmonyError(
            f"virtual-memory runs each microbatch forward then backward, so fwd_microbatch "
            f"({plan.fwd_microbatch}) must equal bwd_microbatch ({plan.bwd_microbatch})"
        )


def _microbatches(plan: Plan) -> list[list[tuple[int, int]]]:
    shares = [s for s in replica_shares(plan.minibatch, plan.n_gpus) if s[1] > s[0]]
    return [microbatches(s, plan.fwd_microbatch) for s in shares]


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    _check(plan)
    b = GraphBuilder(spec, hw, plan, model)
    offload = plan.option("offload_activations")
    per_replica = _microbatches(plan)
    ops = []
    for m in range(max(len(mbs) for mbs in per_replica)):
        for r, mbs in enumerate(per_replica):
            if m >= len(mbs):
                continue
            for kind, p in pack_sequence(plan):
                layers = plan.fwd_packs[p] if kind == FWD else plan.bwd_packs[p]
                tag = "F" if kind == FWD else "B"
                ops.append(Op(kind, r, p, layers, mbs[m], m, (tag, p, m), offload))
    b.run(ops)
    by_pack: dict[int, list[int]] = {}
    for group in b.bwd_groups:
        by_pack.setdefault(group.pack, []).append(b.grad_out(group).id)
    for pack, outs in sorted(by_pack.items(), reverse=True):
        b.update(pack, plan.bwd_packs[pack], outs, worker=pack)
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan) -> dict[str, float]:
    _check(plan)
    B = plan.minibatch
    n_mb = sum(len(mbs) for mbs in _microbatches(plan))
    stash_out, stash_in = stash_bytes(spec, plan, B)
    moved = boundary_bytes(spec, plan, B) if plan.option("offload_activations") else 0.0
    return {
        "W_IN": n_mb * pack_weight_bytes(spec, plan),
        "G_OUT": n_mb * spec.grad_bytes(),
        "STASH_OUT": stash_out,
        "STASH_IN": stash_in,
        "DATA_IN": data_bytes(spec, B),
        "P2P": 0.0,
        "ACT_OUT": moved,
        "ACT_IN": moved,
        "REDUCE": 0.0,
    }
