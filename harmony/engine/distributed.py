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
in a fixed order (backward order: last pack first), the next one only once
the previous update has been applied. A server that dies makes the others
fail within the process group's timeout instead of hanging.

A non-finite loss on one server must not stop it before the exchange (the
others would wait until the timeout): its updates send NaN instead, so every
server finds a non-finite averaged gradient at the same pack, and every server
stops there, issuing no further collective in that step.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import HarmonyError
from ..plan import Plan
from .buffers import copy_runs


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


def leave_process_group(finished: bool = True) -> None:
    """Leave the process group :func:`init_from_env` joined, if any; a server that
    ``finished`` its run first waits for the others to finish theirs (one that failed
    does not: the others' collectives would not match, and they fail on their own).

    The barrier is a second guard for the abort :class:`GradientSync` prevents (a gloo
    thread freeing a collective's tensors, which takes the GIL, while the interpreter
    exits: "terminate called without an active exception"): once it returns, gloo's
    threads are past every earlier collective of this server, and the group goes before
    the interpreter does. Its own tensor is not Python's."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            # another server that failed never comes: its own error says why
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        dist.destroy_process_group()
        gc.collect()


class GradientSync:
    """Averages each update's gradients across servers, in one order on every server."""

    def __init__(self, order: list[tuple[int, int]], group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.order = order
        self._turn = 0
        self._failed = False
        self._cond = threading.Condition()
        self._works: list = []  # this step's all-reduces, held (see average)

    def start_step(self) -> None:
        with self._cond:
            self._turn = 0
            self._failed = False
            self._works = []  # let go here, long after gloo's threads did

    @contextlib.contextmanager
    def update(self, key: tuple[int, int]):
        """The update of ``key``, in its turn: average inside, then apply; the
        next update's exchange starts when this one is done. If it fails, the
        step's later updates exchange nothing (every server fails at the same
        update when the failure is a non-finite average)."""
        with self._cond:
            while not self._failed and self.order[self._turn] != key:
                self._cond.wait()
            if self._failed:
                raise HarmonyError(
                    f"the update of pack {key[0]} was not run: an earlier update of this step "
                    "failed"
                )
        try:
            yield
        except BaseException:
            with self._cond:
                self._failed = True
                self._cond.notify_all()
            raise
        with self._cond:
            self._turn += 1
            self._cond.notify_all()

    def average(
        self, key: tuple[int, int], params: list[torch.Tensor], poison: bool = False
    ) -> None:
        """Average the gradients of ``params`` with the other servers' (inside
        :meth:`update`); with ``poison``, this server's share is NaN (its step
        failed), so every server's average is. Gradients that lie in one run of
        memory (a pack's, in the host's flat gradient buffer) are averaged in
        place; others through one gathered copy."""
        grads = [p.grad for p in params]
        runs = copy_runs([(g, g) for g in grads]) if all(g is not None for g in grads) else []
        flat = (
            runs[0][0]
            if len(runs) == 1
            else torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(grads, params)
                ]
                if params
                else [torch.zeros(0)]
            )
        )
        if poison:
            flat.fill_(float("nan"))
        try:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            work.wait()
        except RuntimeError as e:
            raise HarmonyError(
                f"all-reduce of the gradients of pack {key[0]} failed: another server stopped or "
                f"timed out ({e})"
            ) from None
        flat /= self.world
        # The all-reduce is held until the next step. The gloo thread that ran it lets go
        # of it after this thread has the result; were it the last to hold it, freeing its
        # tensors would take the GIL there, and after a run's last step the interpreter may
        # be exiting: the thread is then made to exit inside a C++ destructor and the
        # process aborts ("terminate called without an active exception"). Held here, it
        # is freed by a Python thread, which holds the GIL.
        self._works.append(work)
        if len(runs) != 1:  # a gathered copy: back into the gradients
            at = 0
            for p in params:
                n = p.numel()
                if p.grad is None:
                    p.grad = flat[at : at + n].view_as(p).clone()
                else:
                    p.grad.copy_(flat[at : at + n].view_as(p))
                at += n


def check_same_plan(plan: Plan, group=None) -> None:
    """Every server must run the same plan, or collectives would not match."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise HarmonyError(
            "servers run different plans; give every server the same plan (or plan='auto' "
            "with identical models and minibatch sizes)"
        )


def broadcast_weights(module: torch.nn.Module, group=None) -> None:
    """Start every server from rank 0's weights and buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0, group=group)


def gradient_sync_for(plan: Plan, optimizers: dict) -> GradientSync:
    """The exchange of ``plan``'s gradients across servers (every server's plan
    checked to be the same), in the order the updates run: last pack first."""
    check_same_plan(plan)
    order = sorted(
        (k for k, opt in optimizers.items() if opt is not None),
        key=lambda k: (-k[0], k[1]),
    )
    return GradientSync(order)
