"""Pieces of schedules that several policies share."""

from __future__ import annotations

from ..graph import BWD, FWD, FWDBWD
from ..plan import Plan, split_samples
from ..spec import ModelSpec
from .builder import Op


def replica_shares(minibatch: int, n: int) -> list[tuple[int, int]]:
    """Sample ranges of ``n`` data-parallel replicas, as even as possible."""
    out, at = [], 0
    for r in range(n):
        size = minibatch // n + (1 if r < minibatch % n else 0)
        out.append((at, at + size))
        at += size
    return out


def microbatches(share: tuple[int, int], size: int) -> list[tuple[int, int]]:
    a, b = share
    return [(a + x, a + y) for x, y in split_samples(b - a, size)]


def pack_sequence(plan: Plan) -> list[tuple[str, int]]:
    """Harmony's task order for one minibatch: forward packs, the fused last
    pack, then backward packs from the end: (kind, pack index)."""
    seq = [(FWD, p) for p in range(len(plan.fwd_packs))]
    seq.append((FWDBWD, len(plan.bwd_packs) - 1))
    seq += [(BWD, q) for q in range(len(plan.bwd_packs) - 2, -1, -1)]
    return seq


def grouped_ops(plan: Plan, share: tuple[int, int], gpu_of_step, offload) -> list[list[Op]]:
    """Input-batch grouping: each step of :func:`pack_sequence` runs over every
    microbatch of ``share`` while its weights are resident. Returns one list
    of ops per step. ``gpu_of_step(i)`` places step ``i``; ``offload(i)`` says
    whether step ``i``'s output goes through host memory."""
    steps = []
    for i, (kind, p) in enumerate(pack_sequence(plan)):
        packs, size = (plan.fwd_packs, plan.fwd_microbatch) if kind == FWD else (plan.bwd_packs, plan.bwd_microbatch)
        steps.append([
            Op(kind, gpu_of_step(i), p, packs[p], mb, m, ("F" if kind == FWD else "B", p), offload(i))
            for m, mb in enumerate(microbatches(share, size))
        ])
    return steps


def boundary_bytes(spec: ModelSpec, plan: Plan, samples: int) -> float:
    """Bytes crossing every pack boundary once for ``samples`` samples: the
    activations between forward packs (and into the fused pack) plus the
    activation gradients between backward packs."""
    fwd = sum(spec.input_bytes(p[1], samples) for p in plan.fwd_packs)
    bwd = sum(spec.input_bytes(p[0], samples) for p in plan.bwd_packs[1:])
    return fwd + bwd


def stash_bytes(spec: ModelSpec, plan: Plan, samples: int) -> tuple[float, float]:
    """(out, in) bytes of stashed backward-pack inputs; layer 0's input is the
    minibatch itself, already in host memory, so it only comes back in."""
    layers = plan.stash_layers()
    out = sum(spec.input_bytes(l, samples) for l in layers if l > 0)
    back = sum(spec.input_bytes(l, samples) for l in layers)
    return out, back


def data_bytes(spec: ModelSpec, samples: int) -> float:
    return spec.input_bytes(0, samples) + spec.target_bytes(samples)


def pack_weight_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Weights loaded by one pass of every forward pack and every backward pack."""
    return spec.weight_bytes(0, plan.bwd_packs[-1][0]) + spec.weight_bytes()
