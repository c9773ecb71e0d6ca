"""A step's bookkeeping: the device memory its buffers hold, its copies, its bytes.

:class:`StepMemory` is the part of :class:`~harmony.engine.step.run.StepRun` that
keeps what each graph buffer holds on its device (charged to that device's
ledger, dropped when the graph frees the buffer), takes pooled buffers for
the step's copies (given back when the step ends) and converts values to the
dtype they cross the links in under mixed precision; :class:`BytesMoved`
counts the bytes each task moves (pacing them to the emulated links).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Callable

import torch

from ...costs.hardware import format_bytes
from ...graph import UPD, Task, TaskGraph
from ..buffers import BufferPool, copy_runs
from ..context import StepContext
from ..devices import Backend
from ..meters import Unmetered, WorkMeter
from ..tiers.pacing import LinkPacer
from .casts import KeptCasts, stage


def nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or tuples, lists, dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0


def assemble(pieces: list[tuple[tuple[int, int], tuple]], a: int, b: int) -> tuple:
    """The samples [a, b) of a value split in sample ranges (batch dimension 0)."""
    pieces = sorted(pieces, key=lambda p: p[0][0])
    if len(pieces) == 1 and pieces[0][0] == (a, b):
        return pieces[0][1]
    lo = pieces[0][0][0]
    out = []
    for i in range(len(pieces[0][1])):
        parts = [p[1][i] for p in pieces]
        if parts[0] is None:
            out.append(None)
            continue
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        out.append(whole[a - lo : b - lo])
    return tuple(out)


class BytesMoved:
    """Owns the bytes the step's tasks moved, by kind and by task, and paces them.

    ``pacer``: the links' pacer, which an emulated copy waits on (``paced``: some
    device is emulated); ``lock``: the step's lock."""

    def __init__(self, pacer: LinkPacer, paced: bool, lock: threading.Lock):
        self.pacer, self.paced, self.lock = pacer, paced, lock
        self.moved: dict[str, float] = defaultdict(float)  # bytes by task kind
        self.moved_task: dict[int, float] = {}

    def count(self, task: Task, n: float, started: float, pace: bool = True) -> None:
        """Count ``n`` bytes for ``task`` and, emulated (and ``pace``), make the copy
        last as long as the links of its route allow."""
        if self.paced and pace:
            self.pacer.wait(task.links, n, task.max_rate, started)
        with self.lock:
            self.moved[task.kind] += n
            self.moved_task[task.id] = self.moved_task.get(task.id, 0.0) + n


class StepMemory:
    """Owns what each graph buffer holds on its device, the pooled buffers, the tasks left.

    Given the step's ``ctx`` and ``graph``, its devices (``backends``: name ->
    backend), its ``lock``, ``moved`` (:meth:`BytesMoved.count`) and ``freed``,
    told each buffer the graph frees once its value is dropped (the disk part's
    :meth:`~.disk.DiskSteps.buffer_freed`; None: no one needs telling)."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        backends: dict[str, Backend],
        lock: threading.Lock,
        moved: Callable,
        freed: Callable[[int], None] | None,
    ):
        self.ctx, self.graph, self.backends, self.lock = ctx, graph, backends, lock
        self._moved, self.buffer_freed = moved, freed
        self.dtype = ctx.compute_dtype  # None: float32 throughout
        self.store: dict[int, object] = {}  # buffer id -> what the device holds
        self.charged: dict[int, tuple] = {}  # buffer id -> (bytes held, bytes beyond declared)
        self.refs = [b.refs for b in graph.buffers]
        # Buffers from the pools go back when the step ends, not when the graph frees
        # them: each of a step's copies then has its own buffer, so how many of each
        # size a step takes is fixed by the plan, whatever order the lanes ran in, and
        # no value can be overwritten while a view of it is still held anywhere.
        self.taken: list[tuple[torch.Tensor, BufferPool]] = []
        self.kept = KeptCasts(ctx.host.pool) if ctx.keep_casts else None
        self.tasks_left = len(graph.tasks)
        #: tasks other than updates not yet ended (the step's point of no return: none)
        self.others_left = sum(t.kind != UPD for t in graph.tasks)

    # ---- bookkeeping --------------------------------------------------------------
    # The executor charges each buffer's declared bytes to its device when the task
    # that makes it is admitted (see harmony.engine.admission); a step only notes the
    # bytes its tensors really take and charges what goes beyond the declared size.
    def reserve(self, buf: int, nbytes: int) -> None:
        """``buf`` is about to hold ``nbytes`` (before a copy fills it)."""
        b = self.graph.buffers[buf]
        ledger = self.backends[b.device].ledger
        excess = max(0.0, nbytes - b.nbytes)
        if excess:
            ledger.charge(
                excess,
                f"{b.what}, beyond the {format_bytes(b.nbytes)} its spec declared",
                declared=False,
            )
        ledger.note_held(nbytes)
        with self.lock:
            self.charged[buf] = (nbytes, excess)

    def put(self, buf: int, value) -> None:
        """Keep ``value`` in ``buf`` (noting its bytes unless reserved)."""
        if buf not in self.charged:
            self.reserve(buf, nbytes(value))
        with self.lock:
            self.store[buf] = value

    def finish(self, task: Task) -> None:
        """``task`` ended: the buffers it was the last to use are dropped (one turn of
        the lock for the task's whole bookkeeping: this runs once per task)."""
        freed = []
        with self.lock:
            self.tasks_left -= 1
            self.others_left -= task.kind != UPD
            for b in task.releases:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.store.pop(b, None)
                    freed.append((b, *self.charged.pop(b, (0, 0.0))))
        for b, n, excess in freed:
            self._give_back(b, n, excess)
            if self.buffer_freed is not None:
                self.buffer_freed(b)

    def drop_all(self) -> list:
        """A failed step: every buffer's charge given back, its value dropped; the values."""
        for buf, (n, excess) in self.charged.items():
            self._give_back(buf, n, excess)
        values = list(self.store.values())
        self.store.clear()
        self.charged.clear()
        return values

    def _give_back(self, buf: int, nbytes: float, excess: float) -> None:
        if not (nbytes or excess):  # a buffer that never held a value (or held no bytes)
            return
        ledger = self.backends[self.graph.buffers[buf].device].ledger
        ledger.note_held(-nbytes)
        ledger.release(excess, declared=False)

    def work_meter(self, task: Task) -> WorkMeter | Unmetered:
        """The meter of what ``task`` holds beyond its buffers, against its declared working
        memory (one that measures nothing where the device does not: ``meters_work``)."""
        backend = self.backends[task.device]
        if not backend.meters_work:
            return Unmetered()
        declared = self.graph.buffers[task.io["work"]].nbytes if "work" in task.io else 0.0
        return WorkMeter(backend.ledger, declared, f"{task.what}")

    def take(self, pool: BufferPool, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer from ``pool``, given back when the step ends."""
        t = pool.take(numel, dtype)
        if numel:
            with self.lock:
                self.taken.append((t, pool))
        return t

    def close(self) -> None:
        """The step is over (done or failed): every buffer taken from a pool goes back."""
        with self.lock:
            taken, self.taken = self.taken, []
        for t, pool in taken:
            pool.give(t)
        if self.kept is not None:
            self.kept.close()

    def allocations(self) -> tuple[int, int]:
        """(tensors, bytes) the pools and the host gradient buffers have made so far."""
        pools = [b.pool for b in self.backends.values() if b.pool is not None] + [
            self.ctx.host.pool
        ]
        grads = [self.ctx.host.layout, self.ctx.gradient_slots]
        grads = [g for g in grads if g is not None]
        return (
            sum(p.allocations for p in pools + grads),
            sum(p.allocated_bytes for p in pools + grads),
        )

    def gradient_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """Where host parameter ``p``'s gradient lands this step: its slot, or a
        buffer of the host layout kept from step to step."""
        slots = self.ctx.gradient_slots
        if slots is not None and slots.holds(p):
            return slots.buffer(p)
        return self.ctx.host.layout.grad_buffer(p)

    def pieces(self, bufs: list[int]) -> list:
        return [(self.graph.buffers[b].samples, self.store[b]) for b in bufs]

    # ---- mixed precision --------------------------------------------------------------
    def low(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it crosses a link or waits in a buffer: floating point in the
        compute dtype under mixed precision, unchanged otherwise."""
        if self.dtype is None or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        return t.detach().to(self.dtype)

    def wire(self, value: tuple) -> tuple:
        return (
            value
            if self.dtype is None
            else tuple(None if t is None else self.low(t) for t in value)
        )

    def wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def wire_bytes(self, t: torch.Tensor) -> int:
        return t.numel() * self.wire_dtype(t).itemsize

    # ---- copies -------------------------------------------------------------------------
    def to_device(
        self,
        backend: Backend,
        tensors: list[torch.Tensor],
        dtypes: list[torch.dtype] | None = None,
        fresh: bool = False,
        non_blocking: bool = True,
        pooled: bool = True,
        keep: bool = False,
    ) -> list[torch.Tensor]:
        """``tensors`` on ``backend``'s device in ``dtypes`` (default: their wire
        dtype): views of one flat buffer per dtype, filled by as few copies as
        the host layout allows. ``fresh``: copies even where the device computes
        on host memory (what the device writes must not reach the host tensors);
        ``non_blocking`` False: the copies are complete on return; ``pooled`` False,
        or a backend without a pool: into new memory (``backend.buffer``), freed with
        the graph's buffer. ``keep``: casts on the way are kept for the step's next load
        of these tensors (see ``StepContext.keep_casts``), where the step keeps them."""
        dtypes = [self.wire_dtype(t) for t in tensors] if dtypes is None else dtypes
        same = all(d == t.dtype for d, t in zip(dtypes, tensors))
        if not backend.copies and same and not fresh:
            return [t.detach() for t in tensors]  # the device computes on host memory as it is
        out: list = [None] * len(tensors)
        for dtype in dict.fromkeys(dtypes):
            chosen = [k for k, d in enumerate(dtypes) if d == dtype]
            numel = sum(tensors[k].numel() for k in chosen)
            flat = (
                backend.buffer(numel, dtype)
                if backend.pool is None or not pooled
                else self.take(backend.pool, numel, dtype)
            )
            pairs, offset = [], 0
            for k in chosen:
                t = tensors[k]
                piece = flat[offset : offset + t.numel()]
                out[k] = piece.view(t.shape).detach()
                pairs.append((piece, t.detach()))
                offset += t.numel()
            # a cast on the way: staged in the host pool's page-locked memory (see .casts)
            kept = self.kept if keep else None
            stage(copy_runs(pairs), self.ctx.host.pool, non_blocking, kept)
        return out

    def to_host(
        self,
        backend: Backend,
        tensors: list[torch.Tensor],
        non_blocking: bool = True,
        pooled: bool = True,
    ) -> list[torch.Tensor]:
        """``tensors`` in host buffers from the host pool (page-locked for a GPU), in
        their wire dtype; on a GPU, ready when the lane's stream has drained
        unless ``non_blocking`` is False; ``pooled`` False: in new memory, freed
        when the last reference goes (a piece the disk tier takes before the step
        ends)."""
        if not backend.copies and all(self.wire_dtype(t) == t.dtype for t in tensors):
            return [t.detach() for t in tensors]
        out = []
        for t in tensors:
            dtype = self.wire_dtype(t)
            flat = (
                self.take(self.ctx.host.pool, t.numel(), dtype)
                if pooled
                else torch.empty(t.numel(), dtype=dtype)
            )
            out.append(flat.view(t.shape))
            out[-1].copy_(t, non_blocking=non_blocking and pooled)
        return out

    def autocast(self, task: Task):
        """Forward computation in the compute dtype, as ``torch.autocast`` runs it."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.backends[task.device].torch_device.type, dtype=self.dtype)

    def _copy(self, task: Task, value, to_device: bool, pooled: bool = True):
        """``value`` copied to the task's device (or to host) in the wire dtype; a
        copy to the device charges its destination buffer before it starts;
        ``pooled``: as for :meth:`to_device` and :meth:`to_host`."""
        started = time.perf_counter()
        backend = self.backends[task.device]
        present = [v for v in value if v is not None]
        if to_device:
            self.reserve(task.io["dst"], sum(self.wire_bytes(v) for v in present))
            copies = iter(self.to_device(backend, present, pooled=pooled))
        else:
            copies = iter(self.to_host(backend, present, pooled=pooled))
        out = tuple(None if v is None else next(copies) for v in value)
        self._moved(task, nbytes(out), started)
        return out
