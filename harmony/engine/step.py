"""One training step of the engine: what each kind of task does with real tensors.

:class:`StepRun` keeps a step's state: the tensors each graph buffer holds on
its device (charged to that device's ledger, dropped when the graph frees the
buffer), the values sent to host memory (stashes, offloaded activations), the
bytes moved, the loss, and a journal of updates to undo if the step fails.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.func import functional_call

from ..costs.hardware import format_bytes
from ..errors import HarmonyError, NonFiniteError, OutOfMemoryError
from ..graph import (
    ACT_IN,
    ACT_OUT,
    BWD,
    DATA_IN,
    FWD,
    FWDBWD,
    G_OUT,
    P2P,
    REC,
    REDUCE,
    STASH_IN,
    STASH_OUT,
    UPD,
    W_IN,
    Task,
    TaskGraph,
    TiedGradients,
)
from ..plan import layer_shard
from ..trace import Trace
from .admission import MemoryOrder
from .buffers import BufferPool, copy_runs
from .devices import Backend, LinkPacer
from .executor import Executor
from .meters import SavedBytes, WorkMeter
from .reference_loop import as_args, seed_layer
from .updates import apply_update
from .updates import optimizer_params as _params

if TYPE_CHECKING:
    from .engine import Engine


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _assemble(pieces: list[tuple[tuple[int, int], tuple]], a: int, b: int) -> tuple:
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


def memory_checks(backends) -> dict:
    """What the devices' ledgers say beyond the peak: the most that tasks held
    beyond what the graph declared for them (0 when the spec counts right) and
    the peak of the tensors themselves (at most the peak)."""
    return {
        "undeclared_bytes": {b.name: b.ledger.undeclared_peak for b in backends},
        "held_peak_memory": {b.name: b.ledger.held_peak for b in backends},
    }


class TieSums:
    """Sums, on the host, the gradient of each parameter tied across packs the
    way autograd sums it in the plain loop: per microbatch, the packs' parts in
    backward order (the highest layers first, as autograd reaches them), and
    those sums over the microbatches in order, into the parameter's ``.grad``."""

    def __init__(self, engine: "Engine", graph: TaskGraph, lock: threading.Lock):
        self.e, self.lock = engine, lock
        self.params: dict[int, torch.Tensor] = {}
        self.packs: dict[int, set] = defaultdict(set)  # parameter -> packs that send a part
        ranges: dict[int, set] = defaultdict(set)
        for t in graph.tasks:
            if isinstance(t.data, TiedGradients):
                for _, _, p in engine.split_ties(*t.data.layers):
                    self.params[id(p)] = p
                    self.packs[id(p)].add(t.data.layers[0])
                    ranges[id(p)].add(t.data.samples)
        self.ranges = {k: sorted(v) for k, v in ranges.items()}
        self.folded = {k: 0 for k in self.params}  # microbatches summed into .grad
        self.parts: dict[tuple, dict[int, torch.Tensor]] = defaultdict(
            dict
        )  # (param, samples) -> pack -> part

    def add(
        self, pack_start: int, samples: tuple[int, int], parts: dict[int, torch.Tensor]
    ) -> None:
        with self.lock:
            for key, part in parts.items():
                self.parts[(key, samples)][pack_start] = part
                self._fold(key)

    def _fold(self, key: int) -> None:
        p, ranges = self.params[key], self.ranges[key]
        while self.folded[key] < len(ranges):
            got = self.parts.get((key, ranges[self.folded[key]]), {})
            if len(got) < len(self.packs[key]):
                return
            del self.parts[(key, ranges[self.folded[key]])]
            ordered = [got[s] for s in sorted(got, reverse=True)]
            total = ordered[0].to(p.dtype)
            for part in ordered[1:]:
                total = total + part.to(p.dtype)
            if p.grad is None:  # a buffer kept from step to step
                p.grad = self.e.host_layout.grad_buffer(p)
                p.grad.copy_(total)
            else:
                p.grad.add_(total)
            self.folded[key] += 1


@dataclass
class Recomputed:
    """What a REC task leaves its BWD (in its working-memory buffer): the pack's
    input and output with autograd's graph between them, the open meter of the
    tensors autograd saved (closed once backward has used them), and the pack's
    buffers as they were before the recompute (BatchNorm statistics), put back
    after backward so that running statistics count each microbatch once."""

    inputs: tuple
    outputs: tuple
    meter: WorkMeter
    buffers: dict


@dataclass
class SharedDevices:
    """A server's devices as several models' steps share them: their ledgers,
    one pacer for their links, and whether compute lanes run concurrently."""

    backends: list[Backend]
    pacer: LinkPacer
    parallel_compute: bool


class StepRun:
    def __init__(
        self,
        engine: "Engine",
        graph: TaskGraph,
        inputs: tuple,
        target: torch.Tensor,
        shared: "SharedDevices | None" = None,
        memory_order: dict | None = None,
    ):
        """``shared``: devices this step shares with other models' steps (several
        models on one server); default: the engine's own, reset for this step.
        ``memory_order``: the order in which :meth:`execute` admits the graph's
        buffers on each device (:class:`harmony.simulate.Played`); None: as they come."""
        self.e, self.graph, self.inputs, self.target = engine, graph, inputs, target
        self.memory_order = memory_order
        self.grads_lock = threading.Lock()
        backends = shared.backends if shared else engine.backends
        self.backends: dict[str, Backend] = {b.name: b for b in backends}
        self.paced = any(b.paced for b in backends)
        self.dtype = engine.compute_dtype  # None: float32 throughout
        self.buffer_writers = self._buffer_writers()
        # BatchNorm-like buffers: how often each layer's host copy was written back in
        # this step, and which version each weight group loaded (a group prefetched
        # before the previous forward of its layers wrote back must refresh them)
        self.buffer_version: dict[int, int] = defaultdict(int)
        self.loaded_version: dict[int, dict[int, int]] = {}
        self.pacer = shared.pacer if shared else LinkPacer(graph.links)
        # the graph sends the gradients of parameters tied across packs per microbatch
        self.splits_ties = any(isinstance(t.data, TiedGradients) for t in graph.tasks)
        self.ties = TieSums(engine, graph, self.grads_lock) if self.splits_ties else None
        # several compute threads: dropout seeds and draws under the engine's lock
        self.parallel_compute = (
            shared.parallel_compute if shared else len(graph.in_order_lanes()) > 1
        )
        self.handlers = {
            W_IN: self.weights_in,
            DATA_IN: self.data_in,
            STASH_IN: self.host_in,
            ACT_IN: self.host_in,
            STASH_OUT: self.host_out,
            ACT_OUT: self.host_out,
            P2P: self.peer_in,
            REDUCE: self.reduce,
            G_OUT: self.grads_out,
            UPD: self.update,
            FWD: self.forward,
            REC: self.recompute,
            BWD: self.backward,
            FWDBWD: self.fused,
        }
        self.store: dict[int, object] = {}  # buffer id -> what the device holds
        self.charged: dict[int, int] = {}
        self.refs = [b.refs for b in graph.buffers]
        self.host: dict[tuple, list] = defaultdict(list)  # (kind, layer) -> [((a, b), value)]
        self.moved: dict[str, float] = defaultdict(float)  # bytes by task kind
        self.moved_task: dict[int, float] = {}
        self.loss = 0.0
        self.poisoned: str | None = None  # why this server sends NaN gradients (across servers)
        self.lock = threading.Lock()
        # Buffers from the pools go back when the step ends, not when the graph frees
        # them: each of a step's copies then has its own buffer, so how many of each
        # size a step takes is fixed by the plan, whatever order the lanes ran in, and
        # no value can be overwritten while a view of it is still held anywhere.
        self.taken: list[tuple[torch.Tensor, BufferPool]] = []
        self.allocations_before = self.allocations()
        # Updates that start while other tasks are still pending are journaled, so a
        # failure later in the step (an error, a non-finite gradient of another
        # pack) can undo them (safe_updates).
        engine.journal.start_step()
        self.tasks_left = len(graph.tasks)
        self.buffers_before = (
            [b.detach().clone() for b in engine.host_module.buffers()]
            if engine.safe_updates
            else None
        )
        self.t0 = time.perf_counter()
        if shared is None:
            for b in backends:
                b.ledger.reset(self.t0)

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
            self.reserve(buf, _nbytes(value))
        with self.lock:
            self.store[buf] = value

    def finish(self, task: Task) -> None:
        with self.lock:
            self.tasks_left -= 1
        for b in task.releases:
            with self.lock:
                self.refs[b] -= 1
                last = self.refs[b] == 0
                if last:
                    self.store.pop(b, None)
                    n, excess = self.charged.pop(b, (0, 0.0))
            if last:
                self._give_back(b, n, excess)

    def _give_back(self, buf: int, nbytes: float, excess: float) -> None:
        ledger = self.backends[self.graph.buffers[buf].device].ledger
        ledger.note_held(-nbytes)
        ledger.release(excess, declared=False)

    def work_meter(self, task: Task) -> WorkMeter:
        """The meter of what ``task`` holds beyond its buffers, against its declared working
        memory."""
        declared = self.graph.buffers[task.io["work"]].nbytes if "work" in task.io else 0.0
        return WorkMeter(self.backends[task.device].ledger, declared, f"{task.what}")

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

    def allocations(self) -> tuple[int, int]:
        """(tensors, bytes) the pools and the host gradient buffers have made so far."""
        pools = [b.pool for b in self.backends.values() if b.pool is not None] + [self.e.host_pool]
        grads = self.e.host_layout
        return (
            sum(p.allocations for p in pools) + grads.allocations,
            sum(p.allocated_bytes for p in pools) + grads.allocated_bytes,
        )

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
    ) -> list[torch.Tensor]:
        """``tensors`` on ``backend``'s device in ``dtypes`` (default: their wire
        dtype): views of one flat buffer per dtype, filled by as few copies as
        the host layout allows."""
        dtypes = [self.wire_dtype(t) for t in tensors] if dtypes is None else dtypes
        if not backend.copies and all(d == t.dtype for d, t in zip(dtypes, tensors)):
            return [t.detach() for t in tensors]  # the device computes on host memory as it is
        out: list = [None] * len(tensors)
        for dtype in dict.fromkeys(dtypes):
            chosen = [k for k, d in enumerate(dtypes) if d == dtype]
            numel = sum(tensors[k].numel() for k in chosen)
            flat = (
                torch.empty(numel, dtype=dtype, device=backend.torch_device)
                if backend.pool is None
                else self.take(backend.pool, numel, dtype)
            )
            pairs, offset = [], 0
            for k in chosen:
                t = tensors[k]
                piece = flat[offset : offset + t.numel()]
                out[k] = piece.view(t.shape).detach()
                pairs.append((piece, t.detach()))
                offset += t.numel()
            for dst, src in copy_runs(pairs):
                dst.copy_(src, non_blocking=True)
        return out

    def to_host(
        self, backend: Backend, tensors: list[torch.Tensor], non_blocking: bool = True
    ) -> list[torch.Tensor]:
        """``tensors`` in host buffers from the host pool (page-locked for a GPU), in
        their wire dtype; on a GPU, ready when the lane's stream has drained
        unless ``non_blocking`` is False."""
        if not backend.copies and all(self.wire_dtype(t) == t.dtype for t in tensors):
            return [t.detach() for t in tensors]
        out = []
        for t in tensors:
            out.append(self.take(self.e.host_pool, t.numel(), self.wire_dtype(t)).view(t.shape))
            out[-1].copy_(t, non_blocking=non_blocking)
        return out

    def autocast(self, task: Task):
        """Forward computation in the compute dtype, as ``torch.autocast`` runs it."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.backends[task.device].torch_device.type, dtype=self.dtype)

    # ---- the step ------------------------------------------------------------------
    def execute(self) -> None:
        admission = None
        if self.memory_order is not None:
            admission = MemoryOrder(
                self.graph,
                self.memory_order,
                {name: b.ledger for name, b in self.backends.items()},
            )
        self.executor = Executor(self.graph, self.run_task, admission)
        try:
            self.wall_s = self.executor.run(self.t0)
        finally:
            self.close()

    def run_task(self, task: Task) -> None:
        """Do one task of the graph, then release what it frees (called on the task's
        lane by an executor: this step's own, or one playing several models' steps)."""
        handle = self.handlers[task.kind]
        try:
            if task.kind == UPD:
                handle(task)
            else:
                with self.backends[task.device].lane(task.lane):
                    handle(task)
        except HarmonyError as err:
            err.args = (
                f"task {task.id} {task.kind} ({task.what}): {err}",
            )  # keeps the type and its fields
            raise err from None
        except torch.OutOfMemoryError as err:  # a real GPU's
            raise OutOfMemoryError(
                f"task {task.id} {task.kind} ({task.what}): {task.device} out of memory ({err}). "
                "Use a plan with smaller microbatches or more (smaller) packs."
            ) from None
        self.finish(task)

    def roll_back(self) -> None:
        """Undo a failed step: host weights, optimizer state and buffers as before it."""
        self.e.journal.undo()
        if self.buffers_before is not None:
            with torch.no_grad():
                for b, old in zip(self.e.host_module.buffers(), self.buffers_before):
                    b.copy_(old)
        for p in self.e.host_module.parameters():
            p.grad = None
        for buf, (n, excess) in self.charged.items():
            self._give_back(buf, n, excess)
        for value in self.store.values():
            if isinstance(value, Recomputed):  # a REC whose BWD never ran
                value.meter.close()
        self.store.clear()
        self.charged.clear()
        self.close()

    def trace(self) -> Trace:
        ex = self.executor
        # buffers the pools had to make during this step: none once the plan has run a step
        (n0, b0), (n1, b1) = self.allocations_before, self.allocations()
        return Trace.from_run(
            self.graph,
            ex.start,
            ex.end,
            [self.moved_task.get(t.id, 0.0) for t in self.graph.tasks],
            {name: b.ledger.peak for name, b in self.backends.items()},
            {name: list(b.ledger.history) for name, b in self.backends.items()},
            capacity={
                name: float(b.ledger.capacity or float("inf")) for name, b in self.backends.items()
            },
            iteration_s=self.wall_s,
            link_bounds=self.paced,
            policy=self.e.plan.policy,
            model=self.e.spec.name,
            hardware=self.e.backend.kind,
            executor="engine",
            new_buffers=n1 - n0,
            new_buffer_bytes=b1 - b0,
            **memory_checks(self.backends.values()),
        )

    # ---- transfers -------------------------------------------------------------------
    def _moved(self, task: Task, n: float, started: float) -> None:
        """Count ``n`` bytes for ``task`` and, emulated, make the copy last as long
        as the links of its route allow."""
        if self.paced:
            self.pacer.wait(task.links, n, task.max_rate, started)
        with self.lock:
            self.moved[task.kind] += n
            self.moved_task[task.id] = self.moved_task.get(task.id, 0.0) + n

    def _copy(self, task: Task, value, to_device: bool):
        """``value`` copied to the task's device (or to host) in the wire dtype; a
        copy to the device charges its destination buffer before it starts."""
        started = time.perf_counter()
        backend = self.backends[task.device]
        present = [v for v in value if v is not None]
        if to_device:
            self.reserve(task.io["dst"], sum(self.wire_bytes(v) for v in present))
            copies = iter(self.to_device(backend, present))
        else:
            copies = iter(self.to_host(backend, present))
        out = tuple(None if v is None else next(copies) for v in value)
        self._moved(task, _nbytes(out), started)
        return out

    def weights_in(self, task: Task) -> None:
        s, e = task.layers
        backend = self.backends[task.device]
        backward = "grads" in task.io
        started = time.perf_counter()
        # a tensor that several layers of the pack share crosses once, and they share
        # its copy (so autograd sums their gradients as it does in the model)
        entries, aliases, first = [], [], {}
        for i in range(s, e):
            for is_param, tensors in (
                (True, self.e.host_params[i]),
                (False, self.e.host_buffers[i]),
            ):
                for name, t in tensors.items():
                    if id(t) in first:
                        aliases.append((i, name, first[id(t)]))
                    else:
                        first[id(t)] = (i, name)
                        entries.append((i, name, t, is_param))
        # under mixed precision, BatchNorm's parameters and statistics keep their dtype
        dtypes = [
            t.dtype if name in self.e.norm_tensors[i] else self.wire_dtype(t)
            for i, name, t, _ in entries
        ]
        sizes = [t.numel() * d.itemsize for (_, _, t, _), d in zip(entries, dtypes)]
        self.reserve(task.io["weights"], sum(sizes))
        split = {id(p) for _, _, p in self.e.split_ties(s, e)} if self.splits_ties else set()
        if backward:
            self.reserve(
                task.io["grads"],
                sum(
                    n
                    for (_, _, t, is_param), n in zip(entries, sizes)
                    if is_param and t.requires_grad and id(t) not in split
                ),
            )
        with self.lock:  # read before the copy: a write-back during it shows as a newer version
            self.loaded_version[task.io["weights"]] = {
                i: self.buffer_version[i] for i in range(s, e) if self.e.host_buffers[i]
            }
        device = self.to_device(backend, [t for _, _, t, _ in entries], dtypes)
        weights: dict[int, dict] = {i: {} for i in range(s, e)}
        for (i, name, t, is_param), d in zip(entries, device):
            # requires_grad as in the model, forward packs too: some kernels choose
            # how to compute by it (matmul folds batch dimensions when the weight
            # requires grad), and forward must compute as the plain loop does
            weights[i][name] = d.requires_grad_(is_param and t.requires_grad)
        for i, name, (j, other) in aliases:
            weights[i][name] = weights[j][other]
        self._moved(task, sum(d.numel() * d.element_size() for d in device), started)
        self.put(task.io["weights"], weights)
        if backward:
            # the gradients this group accumulates: a shared tensor's under its first
            # name only, a split tie's not at all (it leaves per microbatch)
            owned = {(i, name) for i, name, t, _ in entries if id(t) not in split}
            leaves = {
                i: {k: v for k, v in weights[i].items() if v.requires_grad and (i, k) in owned}
                for i in range(s, e)
            }
            self.put(task.io["grads"], leaves)

    def data_in(self, task: Task) -> None:
        what, (a, b) = task.data.what, task.data.samples
        value = tuple(t[a:b] for t in self.inputs) if what == "inputs" else (self.target[a:b],)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def host_in(self, task: Task) -> None:
        kind, layer, (a, b) = task.data.what, task.data.layer, task.data.samples
        if kind == "stash" and layer == 0:
            value = tuple(t[a:b] for t in self.inputs)
        else:
            with self.lock:
                pieces = [p for p in self.host[(kind, layer)] if p[0][0] < b and a < p[0][1]]
            value = _assemble(pieces, a, b)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def host_out(self, task: Task) -> None:
        kind, layer, (a, b) = task.data.what, task.data.layer, task.data.samples
        value = _assemble(self.pieces(task.io["src"]), a, b)
        out = self._copy(task, value, to_device=False)
        with self.lock:
            self.host[(kind, layer)].append(((a, b), out))

    def peer_in(self, task: Task) -> None:
        a, b = task.data.samples
        value = _assemble(self.pieces(task.io["src"]), a, b)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def reduce(self, task: Task) -> None:
        """One GPU's share of a reduce-scatter: its bytes cross the peer link here;
        the sums themselves are formed, in GPU order, when each shard goes out."""
        self._moved(task, task.nbytes, time.perf_counter())

    def grads_out(self, task: Task) -> None:
        """A pack's gradient (data parallel: one shard, summed over the GPUs in
        order) into the host copy's ``.grad``."""
        if isinstance(task.data, TiedGradients):
            self.tied_out(task)
            return
        (s, e), (r, k) = task.data.layers, task.data.shard
        started = time.perf_counter()
        replicas = [self.store[b] for b in task.io["src"]]
        sums = []  # (host parameter, gradient on the device)
        for i in layer_shard((s, e), r, k):
            for name in replicas[0][i]:
                grads = [rep[i][name].grad for rep in replicas if rep[i][name].grad is not None]
                if not grads:
                    continue
                g = grads[0]
                for other in grads[1:]:  # the replicas' sum, formed in GPU order
                    g = g + other.to(g.device, non_blocking=True)
                sums.append((self.e.host_params[i][name], g))
        # Several GPUs may send gradients of the same parameters at once (each its
        # microbatches' share): whether a gradient is the step's first or is added,
        # and the write itself, happen under one lock, copies complete.
        with self.grads_lock:
            first, more = [], []
            for host, g in sums:
                if (
                    host.grad is None
                ):  # a buffer kept from step to step (float32 under mixed precision)
                    host.grad = self.e.host_layout.grad_buffer(host)
                    first.append((host.grad, g))
                else:
                    more.append((host.grad, g))
            for dst, src in copy_runs(first):
                dst.copy_(src)
            for dst, src in more:
                if src.device != dst.device:  # added on the host, after a copy there
                    src = self.to_host(self.backends[task.device], [src], non_blocking=False)[0]
                dst.add_(src)
        self._moved(task, sum(g.numel() * g.element_size() for _, g in sums), started)

    def tied_out(self, task: Task) -> None:
        """One microbatch's gradient of the parameters a pack shares with other
        packs, to the host, where the ties are summed as autograd sums them."""
        s, (a, b) = task.data.layers[0], task.data.samples
        started = time.perf_counter()
        piece = self.store[task.io["src"][0]]
        keys = list(piece)
        host = self.to_host(
            self.backends[task.device], [piece[k] for k in keys], non_blocking=False
        )
        self.ties.add(s, (a, b), dict(zip(keys, host)))
        self._moved(task, sum(piece[k].numel() * piece[k].element_size() for k in keys), started)

    def update(self, task: Task) -> None:
        r = task.data.shard[0]
        key = (task.pack, r)
        opt = self.e.optimizers[key]
        if opt is None:
            return
        with self.e.sync.update(key) if self.e.sync is not None else contextlib.nullcontext():
            if self.e.sync is not None:
                self.e.sync.average(key, _params(opt), poison=self.poisoned is not None)
            if self.e.loss_scale != 1.0:
                grads = [p.grad for p in _params(opt) if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, self.e.loss_scale)
            with self.lock:
                pending = self.tasks_left > 1  # tasks other than this one
            apply_update(
                opt, task.layers, key, self.e.journal if self.e.safe_updates and pending else None
            )
        opt.zero_grad(set_to_none=True)

    # ---- compute ----------------------------------------------------------------------
    def _run_layers(
        self,
        task: Task,
        weights: dict,
        h: tuple,
        stash: dict | None = None,
        meter: WorkMeter | None = None,
    ) -> tuple:
        """Run the task's layers on ``h``. Without autograd (``meter`` given), each
        layer's output is held while the next layer computes (with autograd, the
        saved-tensor meter counts what stays)."""
        s, e = task.layers
        backend = self.backends[task.device]
        gpu = int(task.device[3:])
        held = 0
        try:
            for i in range(s, e):
                if stash and i in stash:
                    self.put(stash[i], self.wire(h))
                module = self.e.replica(gpu, i)
                if not self.parallel_compute:
                    seed_layer(
                        self.e.seed, self.e.step_count, task.samples[0], i, backend.torch_device
                    )
                    h = as_args(functional_call(module, weights[i], h))
                elif i in self.e.random_layers:
                    # several GPUs share the CPU generator: seed and draw without interleaving
                    with self.e.rng_lock:
                        seed_layer(
                            self.e.seed,
                            self.e.step_count,
                            task.samples[0],
                            i,
                            backend.torch_device,
                        )
                        h = as_args(functional_call(module, weights[i], h))
                else:  # draws nothing, so must not reseed under another GPU's dropout
                    h = as_args(functional_call(module, weights[i], h))
                if meter is not None and i < e - 1:
                    n = _nbytes(h)
                    meter.charge(n)
                    meter.release(held)
                    held = n
        finally:
            if meter is not None:
                meter.release(held)
        return h

    def _buffer_writers(self) -> dict[int, str] | None:
        """The device whose forward of each layer updates the host copy of its
        buffers (BatchNorm statistics): in a pipeline the one that runs the layer,
        in data parallel the first replica's (every replica saw other samples).
        None: one replica, every forward writes (a 1-GPU plan, wherever it runs)."""
        if self.e.plan.n_gpus == 1:
            return None
        writers: dict[int, str] = {}
        for t in sorted(
            (t for t in self.graph.tasks if t.kind in (FWD, FWDBWD)),
            key=lambda t: int(t.device[3:]),
        ):
            for i in range(*t.layers):
                writers.setdefault(i, t.device)
        return writers

    def _write_back_buffers(self, task: Task, weights: dict) -> None:
        """BatchNorm-like buffers changed by a real forward go back to the host copy."""
        with torch.no_grad():
            for i in range(*task.layers):
                if self.buffer_writers is not None and self.buffer_writers[i] != task.device:
                    continue
                for name, b in self.e.host_buffers[i].items():
                    b.copy_(weights[i][name])
                if self.e.host_buffers[i]:
                    with self.lock:
                        self.buffer_version[i] += 1
                        self.loaded_version[task.io["weights"]][i] = self.buffer_version[
                            i
                        ]  # in sync

    def _refresh_buffers(self, task: Task, weights: dict) -> None:
        """Before a real forward: buffers loaded before an earlier forward of the
        same layers wrote back are brought up to date from the host copy."""
        loaded = self.loaded_version.get(task.io["weights"], {})
        with torch.no_grad():
            for i in range(*task.layers):
                if self.buffer_writers is not None and self.buffer_writers[i] != task.device:
                    continue  # a replica whose statistics are not kept
                if i in loaded and loaded[i] != self.buffer_version[i]:
                    for name, b in self.e.host_buffers[i].items():
                        weights[i][name].copy_(b)
                    loaded[i] = self.buffer_version[i]

    def forward(self, task: Task) -> None:
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        h = _assemble(self.pieces(task.io["input"]), a, b)
        self._refresh_buffers(task, weights)
        meter = self.work_meter(task)
        try:
            with torch.no_grad(), self.autocast(task):
                out = self._run_layers(task, weights, h, task.io.get("stash"), meter)
        finally:
            meter.close()
        self.put(task.io["output"], self.wire(out))
        self._write_back_buffers(task, weights)

    def _autograd_input(self, task: Task, role: str) -> tuple:
        """The pack's input (``task.io[role]``) for a forward with autograd: past the
        first layer its floating-point tensors require grad (their gradient is the
        pack's output)."""
        a, b = task.samples
        h = _assemble(self.pieces(task.io[role]), a, b)
        if task.layers[0] > 0:
            h = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in h)
        return h

    def _saved_meter(
        self, task: Task, weights: dict, h: tuple, *more
    ) -> tuple[WorkMeter, SavedBytes]:
        """The task's work meter, and the hook that charges it what autograd saves."""
        work = self.work_meter(task)
        # the weights, the pack's input and the labels are buffers of their own
        held = [t for w in weights.values() for t in w.values()] + list(h) + list(more)
        return work, SavedBytes(work.charge, exclude=held)

    def recompute(self, task: Task) -> None:
        """REC: the pack's forward again, with autograd, from its stashed input. The
        graph autograd records and the tensors it saves (metered against the task's
        working memory) wait in that working-memory buffer for the op's BWD."""
        s, e = task.layers
        weights = self.store[task.io["weights"]]
        h = self._autograd_input(task, "stash_in")
        buffers = {
            (i, name): weights[i][name].clone()
            for i in range(s, e)
            for name in self.e.host_buffers[i]
        }
        work, meter = self._saved_meter(task, weights, h)
        try:
            with meter, torch.enable_grad(), self.autocast(task):
                out = self._run_layers(task, weights, h)
        except BaseException:
            work.close()
            raise
        self.put(task.io["work"], Recomputed(h, out, work, buffers))

    def backward(self, task: Task) -> None:
        """BWD: backward through what the op's REC recorded, from the output gradient."""
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        rec: Recomputed = self.store[task.io["saved"]]
        try:
            grad_in = _assemble(self.pieces(task.io["grad_in"]), a, b)
            pairs = [
                (o, g.to(o.dtype))
                for o, g in zip(rec.outputs, grad_in)
                if g is not None and o.requires_grad
            ]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            rec.meter.close()
        self._tied_piece(task, weights)
        with torch.no_grad():  # recompute must not count twice in running statistics
            for (i, name), old in rec.buffers.items():
                weights[i][name].copy_(old)
        self._input_grad_out(task, rec.inputs)

    def fused(self, task: Task) -> None:
        """FWDBWD: the last pack's forward with autograd, the loss and backward."""
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        self._refresh_buffers(task, weights)
        h = self._autograd_input(task, "input")
        y = self.store[task.io["labels"]][0]
        work, meter = self._saved_meter(task, weights, h, y)
        try:
            with meter, torch.enable_grad(), self.autocast(task):
                out = self._run_layers(task, weights, h)
                loss = self.e.loss_fn(*out, y) * ((b - a) / self.graph.samples)
            if not torch.isfinite(loss.detach()).all():
                what = f"the loss of samples {a}..{b - 1} is {loss.item()}"
                if self.e.sync is None:
                    raise NonFiniteError(what, "loss")
                # Across servers, stopping here would leave the others waiting in the
                # gradient exchange: the step goes on, and this server's updates send
                # NaN, so that every server finds a non-finite gradient at the same pack.
                with self.lock:
                    self.poisoned = self.poisoned or what
            (loss * self.e.loss_scale if self.e.loss_scale != 1.0 else loss).backward()
            with self.lock:
                self.loss += loss.item()
        finally:
            work.close()
        self._tied_piece(task, weights)
        self._write_back_buffers(task, weights)
        self._input_grad_out(task, h)

    def _tied_piece(self, task: Task, weights: dict) -> None:
        """This microbatch's part of the ties, on its own (see :meth:`tied_out`)."""
        if "tied" not in task.io:
            return
        piece = {}
        for i, name, p in self.e.split_ties(*task.layers):
            leaf = weights[i][name]
            piece[id(p)] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            leaf.grad = None
        self.put(task.io["tied"], piece)

    def _input_grad_out(self, task: Task, h: tuple) -> None:
        """The gradient of the pack's input, for the pack before it."""
        if task.layers[0] > 0:
            self.put(
                task.io["output"],
                self.wire(
                    tuple(
                        t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                        for t in h
                    )
                ),
            )
