"""One training step of the engine: a task graph played with real tensors.

:class:`StepRun` keeps a step's state: the tensors each graph buffer holds on
its device (charged to that device's ledger, dropped when the graph frees the
buffer), the values sent to host memory (stashes, offloaded activations), the
bytes moved, the loss, and a journal of updates to undo if the step fails. It
reads only its :class:`~harmony.engine.context.StepContext`. What each kind
of task does is in the parts it is made of, one module per job:
:mod:`.step_memory` (buffers, copies, bytes), :mod:`.transfers`,
:mod:`.compute`, :mod:`.optimizer_steps` and :mod:`.disk_steps`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..errors import HarmonyError, OutOfMemoryError
from ..graph import (
    ACT_IN,
    ACT_OUT,
    BWD,
    DATA_IN,
    DISK_IN,
    DISK_OUT,
    FWD,
    FWDBWD,
    G_IN,
    G_OUT,
    OPT_IN,
    OPT_OUT,
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
from ..trace import Trace
from .accumulators import Accumulators
from .admission import MemoryOrder
from .buffers import BufferPool
from .compute import Compute, Recomputed
from .context import StepContext
from .devices import Backend
from .disk_steps import DiskSteps
from .executor import Executor
from .optimizer_steps import PackCommits, Updates
from .step_memory import StepMemory
from .tiers.pacing import LinkPacer
from .ties import TieSums
from .transfers import Transfers


def memory_checks(backends) -> dict:
    """What the devices' ledgers say beyond the peak: the most that tasks held
    beyond what the graph declared for them (0 when the spec counts right), the
    most working memory a task was declared and never held (0 when the spec does
    not overcount) and the peak of the tensors themselves (at most the peak)."""
    return {
        "undeclared_bytes": {b.name: b.ledger.undeclared_peak for b in backends},
        "unheld_work_bytes": {b.name: b.ledger.unheld_work for b in backends},
        "held_peak_memory": {b.name: b.ledger.held_peak for b in backends},
    }


@dataclass
class SharedDevices:
    """A server's devices as several models' steps share them: their ledgers,
    one pacer for their links, and whether compute lanes run concurrently."""

    backends: list[Backend]
    pacer: LinkPacer
    parallel_compute: bool


class StepRun(StepMemory, Transfers, Compute, Updates, DiskSteps):
    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        inputs: tuple,
        target: torch.Tensor,
        shared: SharedDevices | None = None,
        memory_order: dict | None = None,
    ):
        """``shared``: devices this step shares with other models' steps (several
        models on one server); default: the engine's own, reset for this step.
        ``memory_order``: the order in which :meth:`execute` admits the graph's
        buffers on each device (:class:`harmony.simulate.Played`); None: as they come."""
        self.ctx, self.graph, self.inputs, self.target = ctx, graph, inputs, target
        self.memory_order = memory_order
        self.grads_lock = threading.Lock()
        backends = shared.backends if shared else ctx.backends
        self.backends: dict[str, Backend] = {b.name: b for b in backends}
        self.paced = any(b.paced for b in backends)
        self.dtype = ctx.compute_dtype  # None: float32 throughout
        self.buffer_writers = self._buffer_writers()
        # BatchNorm-like buffers: how often each layer's host copy was written back in
        # this step, and which version each weight group loaded (a group prefetched
        # before the previous forward of its layers wrote back must refresh them)
        self.buffer_version: dict[int, int] = defaultdict(int)
        self.loaded_version: dict[int, dict[int, int]] = {}
        self.pacer = shared.pacer if shared else LinkPacer(graph.links)
        # the graph sends the gradients of parameters tied across packs per microbatch
        self.splits_ties = any(isinstance(t.data, TiedGradients) for t in graph.tasks)
        self.ties = (
            TieSums(ctx.host, graph, self.grads_lock, self.gradient_buffer)
            if self.splits_ties
            else None
        )
        # gradient sums kept on the GPUs, and updates on them (the plan's options)
        gpu_sums = ctx.plan.option("gpu_gradients")
        self.accumulators = Accumulators(graph) if gpu_sums else None
        self.commits = PackCommits(graph)
        self.setup_disk()
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
            G_IN: self.grads_in,
            OPT_IN: self.state_in,
            UPD: self.update,
            OPT_OUT: self.state_out,
            FWD: self.forward,
            REC: self.recompute,
            BWD: self.backward,
            FWDBWD: self.fused,
            DISK_IN: self.disk_in,
            DISK_OUT: self.disk_out,
        }
        self.store: dict[int, object] = {}  # buffer id -> what the device holds
        self.charged: dict[int, int] = {}
        self.refs = [b.refs for b in graph.buffers]
        # (kind, layer) -> [((a, b), value)] sent to host memory
        self.on_host: dict[tuple, list] = defaultdict(list)
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
        if ctx.journal is not None:
            ctx.journal.start_step()
        self.tasks_left = len(graph.tasks)
        self.buffers_before = (
            [b.detach().clone() for b in ctx.host.module.buffers()]
            if ctx.journal is not None
            else None
        )
        self.t0 = time.perf_counter()
        if shared is None:
            for b in backends:
                b.ledger.reset(self.t0)

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
            if task.device not in self.backends:  # on the host: an update, a disk transfer
                handle(task)
            else:
                with self.backends[task.device].lane(task.lane):
                    handle(task)
        except HarmonyError as err:
            # keeps the type and its fields
            err.args = (f"task {task.id} {task.kind} ({task.what}): {err}",)
            raise err from None
        except torch.OutOfMemoryError as err:  # a real GPU's
            raise OutOfMemoryError(
                f"task {task.id} {task.kind} ({task.what}): {task.device} out of memory ({err}). "
                "Use a plan with smaller microbatches or more (smaller) packs."
            ) from None
        self.finish(task)

    def roll_back(self) -> None:
        """Undo a failed step: host weights, optimizer state and buffers as before it."""
        if self.ctx.journal is not None:
            self.ctx.journal.undo()
        if self.buffers_before is not None:
            with torch.no_grad():
                for b, old in zip(self.ctx.host.module.buffers(), self.buffers_before):
                    b.copy_(old)
        for p in self.ctx.host.module.parameters():
            p.grad = None
        if self.ctx.gradient_slots is not None:
            self.ctx.gradient_slots.reset()
        self.disk_roll_back()
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
            policy=self.ctx.plan.policy,
            model=self.ctx.model_name,
            hardware=self.ctx.backends[0].kind,
            executor="engine",
            new_buffers=n1 - n0,
            new_buffer_bytes=b1 - b0,
            **memory_checks(self.backends.values()),
        )
