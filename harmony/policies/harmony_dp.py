"""Harmony-DP (VLDB 2022): data-parallel placement.

Every GPU runs every pack, grouped over the microbatches of its share of the
minibatch (see :mod:`.harmony_pp` for grouping). After a backward pack, the
GPUs reduce-scatter its gradient over the peer links; each GPU sends its
shard (every k-th layer of the pack) to the host and one CPU worker per GPU
updates that shard, so updates run in parallel. (No all-gather is needed: next iteration's weights come
from the host anyway.)
"""

from __future__ import annotations

from ..graph import REDUCE, TaskGraph
from ..hardware import Hardware
from ..plan import Plan
from ..spec import ModelSpec
from .builder import GraphBuilder
from .common import (boundary_bytes, data_bytes, grouped_ops, pack_weight_bytes,
                     replica_shares, stash_bytes)

NAME = "harmony-dp"


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    b = GraphBuilder(spec, hw, plan, model)
    n = plan.n_gpus
    offload = plan.option("offload_activations")
    per_replica = [grouped_ops(plan, share, lambda i, r=r: r, lambda i: offload)
                   for r, share in enumerate(replica_shares(plan.minibatch, n)) if share[1] > share[0]]
    # One global order: step by step, replica by replica.
    b.run([op for i in range(len(per_replica[0])) for steps in per_replica for op in steps[i]])
    by_pack: dict[int, list] = {}
    for group in b.bwd_groups:
        by_pack.setdefault(group.pack, []).append(group)
    for pack, groups in sorted(by_pack.items(), reverse=True):
        k = len(groups)
        done = [g.ops[-1] for g in groups]
        reduce = []
        if k > 1:
            for g in groups:
                dst = groups[(groups.index(g) + 1) % k].gpu
                route, rate = b.p2p_route(g.gpu, dst)
                reduce.append(b.transfer(REDUCE, f"gpu{g.gpu}.p2p", f"gpu{g.gpu}", route,
                                         (k - 1) / k * spec.grad_bytes(*g.layers), done,
                                         f"reduce-scatter gradients {g.layers}", max_rate=rate,
                                         pack=pack, layers=g.layers).id)
        for r, g in enumerate(groups):
            out = b.grad_out(g, deps=reduce, shard=(r, k), replicas=groups)
            b.update(pack, g.layers, [out.id], worker=g.gpu, shard=(r, k))
    return b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan) -> dict[str, float]:
    B = plan.minibatch
    k = sum(1 for a, b in replica_shares(B, plan.n_gpus) if b > a)
    stash_out, stash_in = stash_bytes(spec, plan, B)
    moved = boundary_bytes(spec, plan, B) if plan.option("offload_activations") else 0.0
    return {
        "W_IN": k * pack_weight_bytes(spec, plan),
        "G_OUT": spec.grad_bytes(),
        "STASH_OUT": stash_out,
        "STASH_IN": stash_in,
        "DATA_IN": data_bytes(spec, B),
        "P2P": 0.0,
        "ACT_OUT": moved,
        "ACT_IN": moved,
        "REDUCE": (k - 1) * spec.grad_bytes() if k > 1 else 0.0,
    }
