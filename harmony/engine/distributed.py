"""Data parallel across servers over torch.distributed.

Each process is one server running its own plan on its own minibatch. When a
pack's gradient has reached the host, that pack's update first averages it
across servers (an all-reduce on host tensors: gloo on CPU; NCCL needs device
tensors and is not used for host-side updates), then steps. The all-reduce of
one pack overlaps the backward of the packs before it, and since every server
applies the same update to the same weights, all servers end each step with
identical weights.

Collectives must be issued in the same order everywhere, but updates run on
several CPU threads: a :class:`GradientSync` lets them through one at a time
in a fixed order (backward order: last pack first). A server that dies makes
the others fail within the process group's timeout instead of hanging.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import HarmonyError
from ..plan import Plan


def init_from_env(timeout_s: float = 60.0) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT in the environment); gloo, with a timeout so a lost server is
    an error. Returns False when not launched as several processes."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return True


class GradientSync:
    """Averages each update's gradients across servers, in one order on every server."""

    def __init__(self, order: list[tuple[int, int]], group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.order = order
        self._turn = 0
        self._cond = threading.Condition()

    def start_step(self) -> None:
        with self._cond:
            self._turn = 0

    def average(self, key: tuple[int, int], params: list[torch.Tensor]) -> None:
        with self._cond:
            while self.order[self._turn] != key:
                self._cond.wait()
        try:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
            try:
                dist.all_reduce(flat, group=self.group)
            except RuntimeError as e:
                raise HarmonyError(
                    f"all-reduce of the gradients of pack {key[0]} failed: another server stopped or timed out "
                    f"({e})"
                ) from None
            flat /= self.world
            at = 0
            for p in params:
                n = p.numel()
                p.grad = flat[at:at + n].view_as(p).clone()
                at += n
        finally:
            with self._cond:
                self._turn += 1
                self._cond.notify_all()


def check_same_plan(plan: Plan, group=None) -> None:
    """Every server must run the same plan, or collectives would not match."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise HarmonyError("servers run different plans; give every server the same plan (or plan='auto' "
                           "with identical models and minibatch sizes)")


def broadcast_weights(module: torch.nn.Module, group=None) -> None:
    """Start every server from rank 0's weights and buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0, group=group)
