"""One training step of the engine: a task graph played with real tensors.

:class:`StepRun` plays a step's graph: it builds the parts a step is made of,
one module per job, gives each its collaborators, and sends each task to the
part that does its kind: :class:`~.memory.StepMemory` (what each graph buffer
holds on its device, the pooled copies, the tasks left) and
:class:`~.memory.BytesMoved` (the bytes each task moves), :class:`~.transfers.Transfers`,
:class:`~.compute.Compute` (with :class:`~.compute.BufferVersions` for
BatchNorm statistics), :class:`~.updates.Updates` and :class:`~.disk.DiskSteps`.
It reads only its :class:`~harmony.engine.context.StepContext`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ...errors import HarmonyError, NonFiniteError, OutOfMemoryError
from ...graph import (
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
)
from ...policies import state_on_gpu
from ...trace import Trace
from ..admission import MemoryOrder
from ..context import StepContext
from ..devices import Backend
from ..executor import Executor
from ..tiers.pacing import LinkPacer
from .compute import BufferVersions, Compute, Outcome, Recomputed
from .disk import DiskSteps
from .journal_ahead import JournalAhead
from .memory import BytesMoved, StepMemory
from .resident import ResidentSteps
from .transfers import Transfers
from .updates import Updates


def memory_checks(backends) -> dict:
    """What the devices' ledgers say beyond the peak: the most that tasks held
    beyond what the graph declared for them (0 when the spec counts right), the
    most working memory a task was declared and never held (0 when the spec does
    not overcount) and the peak of the tensors themselves (at most the peak).
    None where a device does not measure what its tasks hold (the cpu backend:
    ``Backend.meters_work``)."""
    backends = list(backends)
    if not all(b.meters_work for b in backends):
        return dict.fromkeys(("undeclared_bytes", "unheld_work_bytes", "held_peak_memory"))
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


class StepRun:
    """A step's graph played with real tensors: the parts that do its tasks, and its trace.

    Made per step from the engine's :class:`~harmony.engine.context.StepContext`,
    the ``graph``, the minibatch (``inputs``, ``target``), the devices it
    ``shared`` with other models' steps (several models on one server; default:
    the context's own, reset for this step) and the ``memory_order`` in which
    :meth:`execute` admits the graph's buffers on each device
    (:class:`harmony.simulate.Played`; None: as they come). :meth:`run_task`
    does one task (an executor calls it on the task's lane), :meth:`roll_back`
    undoes a failed step, :meth:`trace` records a done one. ``loss``: the step's;
    ``poisoned``: why this server sends NaN gradients (across servers)."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        inputs: tuple,
        target: torch.Tensor,
        shared: SharedDevices | None = None,
        memory_order: dict | None = None,
    ):
        self.ctx, self.graph, self.memory_order = ctx, graph, memory_order
        backends = shared.backends if shared else ctx.backends
        self.backends: dict[str, Backend] = {b.name: b for b in backends}
        self.paced = any(b.paced for b in backends)
        self.lock = threading.Lock()
        self.bytes = BytesMoved(
            shared.pacer if shared else LinkPacer(graph.links), self.paced, self.lock
        )
        # (kind, layer) -> [((a, b), value)] sent to host memory
        on_host: dict[tuple, list] = defaultdict(list)
        self.disk = DiskSteps(ctx, graph, self.lock, on_host, self.bytes.count)
        self.memory = StepMemory(
            ctx,
            graph,
            self.backends,
            self.lock,
            self.bytes.count,
            self.disk.buffer_freed if ctx.disk is not None else None,  # only a tier holds loads
        )
        versions = BufferVersions(ctx, graph, self.lock)
        self.transfers = Transfers(
            ctx, graph, inputs, target, self.memory, self.bytes.count, self.disk, versions, on_host
        )
        self.outcome = Outcome()
        # several compute threads: dropout seeds and draws under the engine's lock
        parallel = shared.parallel_compute if shared else len(graph.in_order_lanes()) > 1
        self.compute = Compute(ctx, graph, self.memory, versions, self.outcome, parallel)
        self.updates = Updates(ctx, graph, self.memory, self.bytes.count, self.outcome)
        self.handlers = self._handlers()
        self.allocations_before = self.memory.allocations()
        # Updates that start while other tasks are still pending are journaled, so a
        # failure later in the step (an error, a non-finite gradient of another
        # pack) can undo them (safe_updates).
        if ctx.journal is not None:
            ctx.journal.start_step()
        self.buffers_before = (
            [b.detach().clone() for b in ctx.host.module.buffers()]
            if ctx.journal is not None
            else None
        )
        self.t0 = time.perf_counter()
        if shared is None:
            for b in backends:
                b.ledger.reset(self.t0)

    def _handlers(self) -> dict:
        """Task kind -> the bound method of the part that does it."""
        transfers, compute, updates, disk = self.transfers, self.compute, self.updates, self.disk
        resident = {}
        if state_on_gpu(self.ctx.plan.policy):  # the state stays on the GPU: nothing crosses
            parts = (self.ctx, self.memory, transfers, updates, self.bytes.count)
            resident = ResidentSteps(*parts).handlers()
        return {
            W_IN: transfers.weights_in,
            DATA_IN: transfers.data_in,
            STASH_IN: transfers.host_in,
            ACT_IN: transfers.host_in,
            STASH_OUT: transfers.host_out,
            ACT_OUT: transfers.host_out,
            P2P: transfers.peer_in,
            REDUCE: transfers.reduce,
            G_OUT: transfers.grads_out,
            G_IN: transfers.grads_in,
            OPT_IN: updates.state_in,
            UPD: updates.update,
            OPT_OUT: updates.state_out,
            FWD: compute.forward,
            REC: compute.recompute,
            BWD: compute.backward,
            FWDBWD: compute.fused,
            DISK_IN: disk.disk_in,
            DISK_OUT: disk.disk_out,
        } | resident

    @property
    def loss(self) -> float:
        return self.outcome.loss

    @property
    def poisoned(self) -> str | None:
        return self.outcome.poisoned

    @property
    def moved_task(self) -> dict[int, float]:
        """Bytes each task moved, by task id."""
        return self.bytes.moved_task

    def reported(self, err: NonFiniteError) -> NonFiniteError:
        """The error to report for a non-finite loss or gradient ``err``: across
        servers, every server finds a non-finite gradient, and the one whose loss
        poisoned it says why."""
        if self.outcome.poisoned is None:
            return err
        return NonFiniteError(
            f"{self.outcome.poisoned} on this server; averaged into every server's gradient, "
            "so every server skips the step",
            "gradient",
        )

    def close(self) -> None:
        """The step is over (done or failed): every buffer taken from a pool goes back."""
        self.memory.close()

    def execute(self) -> None:
        admission = None
        if self.memory_order is not None:
            admission = MemoryOrder(
                self.graph,
                self.memory_order,
                {name: b.ledger for name, b in self.backends.items()},
            )
        one_thread = self._nothing_overlaps(admission)
        self.executor = Executor(
            self.graph,
            self.run_task,
            admission,
            one_thread=one_thread,
            order=self._updates_last() if one_thread else None,
        )
        ahead = self._journal_ahead(one_thread)
        try:
            self.wall_s = self.executor.run(self.t0)
            if ahead is not None:
                ahead.stop()
        finally:
            if ahead is not None:
                ahead.stop(raise_error=False)
            self.close()
            self.updates.raise_deferred()

    def _journal_ahead(self, one_thread: bool) -> JournalAhead | None:
        """The journal's copies made during the forward (:mod:`.journal_ahead`), where
        the journal allows it (a GPU's) and the updates overlap other tasks: not on one
        thread, nor with a disk tier (which journals only what is not on disk)."""
        journal = self.ctx.journal
        if journal is None or not journal.ahead or one_thread or self.ctx.disk is not None:
            return None
        ahead = JournalAhead(self.ctx, self.updates)
        ahead.start()
        return ahead

    def _updates_last(self) -> list[Task] | None:
        """The order a step whose lanes only take turns is played in: ``seq`` order with
        the updates no task waits for moved to its end, as a plain loop steps its optimizer
        after the backward. Nothing could overlap them anyway, and the step then reaches its
        point of no return before its first update, so no update is journaled (the journal
        copies each pack's weights and state first: a pass over them as long as the update's
        own). Not where the packs' gradients share slots, which each update frees for the
        next pack's."""
        if self.ctx.gradient_slots is not None:
            return None
        tasks = sorted(self.graph.tasks, key=lambda t: t.seq)
        waited_on = {d for t in tasks for d in t.deps}
        last = [t for t in tasks if t.kind == UPD and t.id not in waited_on]
        late = {t.id for t in last}
        return [t for t in tasks if t.id not in late] + last

    def _nothing_overlaps(self, admission: MemoryOrder | None) -> bool:
        """Whether this step's lanes would only take turns, so that the calling
        thread plays the whole graph (:class:`~harmony.engine.executor.Executor`'s
        ``one_thread``): one compute lane, on a device that computes on host memory
        (a transfer hands a tensor over, no link to pace), no disk tier (its reads
        and writes overlap compute), no exchange across servers (it waits for the
        other servers' turn) and no memory order to wait for. The update lane's
        optimizer steps then run between compute tasks, as in a plain loop: beside
        them they mostly contend with the compute thread for the GIL."""
        return (
            admission is None
            and self.ctx.sync is None
            and self.ctx.disk is None
            and len(self.graph.in_order_lanes()) == 1
            and not any(b.copies or b.paced for b in self.backends.values())
        )

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
        self.memory.finish(task)

    def roll_back(self) -> bool:
        """Settle a failed step: undone (host weights, optimizer state and buffers as
        before it), or, past its point of no return, completed (every update run):
        True then, and the step counts."""
        if self.updates.complete():
            self._drop()
            return True
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
        self.disk.disk_roll_back()
        self._drop()
        return False

    def _drop(self) -> None:
        """What the failed step's buffers hold is dropped, its pooled buffers given back."""
        for value in self.memory.drop_all():
            if isinstance(value, Recomputed):  # a REC whose BWD never ran
                value.meter.close()
        self.close()

    def trace(self) -> Trace:
        ex = self.executor
        # buffers the pools had to make during this step: none once the plan has run a step
        (n0, b0), (n1, b1) = self.allocations_before, self.memory.allocations()
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
