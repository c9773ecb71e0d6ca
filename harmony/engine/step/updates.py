"""What a step's update tasks do: a pack's optimizer step, on the host or on a GPU.

On the host (Harmony's way): a UPD steps the pack's optimizer, on the host
tensors, once the pack's gradient is in.

On a GPU (a plan's ``gpu_optimizer``, as the swapping baselines keep the
optimizer): an OPT_IN copies the pack's parameters, their gradients and the
optimizer's state to the GPU; the UPD steps a copy of the optimizer made
over those device tensors (:func:`device_optimizer`: the same class,
hyperparameters and settings, so the same code and arithmetic as on the
host); an OPT_OUT copies the parameters and the state back. Data parallel,
every replica steps the whole pack on its own GPU, as each replica of
``DistributedDataParallel`` does: all compute the same values, and the host
copy is written once per step, with the first replica's, once every replica
has read it (:class:`PackCommits`). Step counters (0-dim tensors) stay in
host memory, as torch keeps them for an optimizer that does not capture
CUDA graphs, and are not among the bytes moved.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from ...errors import HarmonyError
from ...graph import OPT_IN, UPD, Task, TaskGraph
from ..context import StepContext
from ..journal import apply_update, check_finite_gradients, optimizer_params
from ..optim import FlatAdamW
from ..optim_ready import ready_to_step
from .compute import Outcome
from .memory import StepMemory


@dataclass
class PackState:
    """A pack's parameters (with their gradients) and each one's optimizer state,
    in the optimizer's order: on a GPU after an OPT_IN, on the host after an OPT_OUT."""

    params: list[torch.Tensor]
    state: list[dict]


def _moves(value) -> bool:
    """Whether a state entry crosses the link (a 0-dim step counter does not)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _kept(value):
    """A state entry that stays in host memory, as the device's copy of the optimizer sees it."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def device_optimizer(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], state: list[dict]
) -> torch.optim.Optimizer:
    """A copy of ``opt`` over ``params`` (in the order of ``opt``'s) with ``state``,
    made as unpickling makes one: its class's own code steps it, with ``opt``'s
    hyperparameters and settings."""
    if isinstance(opt, FlatAdamW) and any(p.device.type != "cpu" for p in params):
        raise HarmonyError(
            "FlatAdamW steps tensors in host memory and cannot step on a GPU (the plan's "
            "gpu_optimizer): use torch.optim.AdamW"
        )
    groups, at = [], 0
    for group in opt.param_groups:
        n = len(group["params"])
        groups.append({**group, "params": params[at : at + n]})
        at += n
    twin = type(opt).__new__(type(opt))
    twin.__setstate__(
        {
            **opt.__getstate__(),
            "defaults": dict(opt.defaults),
            "param_groups": groups,
            "state": defaultdict(dict, zip(params, state)),
        }
    )
    return twin


class PackCommits:
    """When each pack's host copy is written: by its first replica's OPT_OUT or
    by the pack's last OPT_IN, whichever ends last (no replica may read a host
    copy another replica has already updated)."""

    def __init__(self, graph: TaskGraph):
        self.readers = Counter(t.pack for t in graph.tasks if t.kind == OPT_IN)
        self.staged: dict[int, PackState] = {}
        self.lock = threading.Lock()

    def read(self, pack: int) -> PackState | None:
        """An OPT_IN of ``pack`` has read the host copy; the result to write, if now."""
        with self.lock:
            self.readers[pack] -= 1
            return self.staged.pop(pack, None) if self.readers[pack] == 0 else None

    def stepped(self, pack: int, replica: int, result: PackState) -> PackState | None:
        """Replica ``replica`` has sent its ``result`` to the host; the result to write, if now."""
        if replica != 0:  # the same values as the first replica's
            return None
        with self.lock:
            if self.readers[pack] == 0:
                return result
            self.staged[pack] = result
            return None


class Updates:
    """Owns when each pack's host copy is written after updates on the GPUs (``commits``).

    Given the step's ``ctx`` and ``graph``, its ``memory`` (buffers, copies, the
    tasks left: an update journals while others may fail), ``moved``
    (:meth:`~.memory.BytesMoved.count`) and ``outcome`` (whether this server's
    gradients are poisoned, to send across servers as NaN)."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        memory: StepMemory,
        moved,
        outcome: Outcome,
    ):
        self.ctx, self.graph, self.memory, self.outcome = ctx, graph, memory, outcome
        self.backends, self.store, self.lock = memory.backends, memory.store, memory.lock
        self.reserve, self.put, self._moved = memory.reserve, memory.put, moved
        self.to_device, self.to_host = memory.to_device, memory.to_host
        self.commits = PackCommits(graph)
        self.host_updates = [t for t in graph.tasks if t.kind == UPD and t.device == "cpu"]
        # The point of no return (commit): every task but the updates has ended and
        # every update left is checked; the updates from there on are not journaled.
        self.committed = self.refused = False  # refused: this step cannot commit
        self.turns = threading.Condition()  # guards committed, claimed, running
        self.claimed: set[int] = set()  # host updates begun (each runs once)
        self.running = 0
        self.deferring = self.interrupted = False  # Ctrl-C held back (_defer_interrupts)

    def update(self, task: Task) -> None:
        if task.device != "cpu":
            self.device_update(task)
            return
        with self.turns:
            if task.id in self.claimed:  # a failed step's settling already ran it
                return
            self.claimed.add(task.id)
            self.running += 1
        try:
            self._host(task)
        finally:
            with self.turns:
                self.running -= 1
                self.turns.notify_all()

    def _host(self, task: Task) -> None:
        key = (task.pack, task.data.shard[0])
        opt = self.ctx.optimizers[key]
        if opt is not None:
            self.host_update(task, key, opt)
        if self.ctx.gradient_slots is not None:  # the pack's gradients are dropped
            self.ctx.gradient_slots.updated(task.pack)

    def complete(self) -> bool:
        """After a failure (an interrupt, say): a step past its point of no return
        runs the updates it has left, so it ends done, not half done (True); else
        nothing happens here (False: the step is to be undone)."""
        with self.turns:
            if not self.committed:
                return False
            left = [t for t in self.host_updates if t.id not in self.claimed]
            self.claimed.update(t.id for t in left)
            self.running += len(left)
        try:
            for t in left:
                self._host(t)
        finally:
            with self.turns:
                self.running -= len(left)
                self.turns.wait_for(lambda: self.running == 0)  # updates on other lanes
        return True

    def host_update(self, task: Task, key: tuple[int, int], opt: torch.optim.Optimizer) -> None:
        """Step ``opt`` (update ``task`` of the unit ``key``) on the host tensors."""
        sync = self.ctx.sync
        with sync.update(key) if sync is not None else contextlib.nullcontext():
            if sync is not None:
                sync.average(key, optimizer_params(opt), poison=self.outcome.poisoned is not None)
            if self.ctx.loss_scale != 1.0:
                grads = [p.grad for p in optimizer_params(opt) if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, self.ctx.loss_scale)
            disk = self.ctx.disk
            on_disk = disk.units[key].kinds if disk is not None and key in disk.units else ()
            journal = self._journal(task)
            apply_update(opt, task.layers, key, journal, on_disk, checked=self.committed)
        opt.zero_grad(set_to_none=True)

    def _journal(self, update: Task | None = None):
        """The journal a change of the host copy records in: none once every other
        task has ended, nor past the point of no return, which the host ``update``
        about to run may reach (:meth:`_commit`)."""
        if self.ctx.journal is None:
            return None
        with self.turns:
            with self.lock:
                pending = self.memory.tasks_left > 1  # tasks other than this one
                only_updates = self.memory.others_left == 0
            if self.committed or (update is not None and only_updates and self._commit(update)):
                return None
        return self.ctx.journal if pending else None

    def _commit(self, update: Task) -> bool:
        """Whether the step can pass its point of no return as ``update`` starts, the
        updates left (``update`` and those not begun) checked now, as each would be
        before its step: every gradient finite, every optimizer ready to step state it
        has, so that nothing but the interpreter can make it fail
        (:func:`~harmony.engine.optim_ready.ready_to_step`).
        Not across servers (an update waits on the others), with a disk tier, nor
        under a loss scale below 1 (unscaling could overflow a finite gradient)."""
        if self.refused:  # what refused it holds for the rest of the step
            return False
        left = [update] + [t for t in self.host_updates if t.id not in self.claimed]
        opts = [(t, self.ctx.optimizers[(t.pack, t.data.shard[0])]) for t in left]
        self.refused = (
            self.ctx.sync is not None
            or self.ctx.disk is not None
            or self.ctx.loss_scale < 1
            or not all(ready_to_step(opt) for _, opt in opts if opt is not None)
        )
        if self.refused:  # each update checks its own gradients, as before
            return False
        for t, opt in opts:  # a non-finite gradient fails the step here, still undoable
            if opt is not None:
                check_finite_gradients(opt, t.layers)
        self.committed = True
        if threading.current_thread() is threading.main_thread():
            self._defer_interrupts()  # this thread runs updates that are not journaled
        return True

    def _defer_interrupts(self) -> None:
        """Ctrl-C past the point of no return, on the thread that runs the updates
        left: noted, and raised once they have run (:meth:`raise_deferred`)."""
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # a handler of the caller's own: theirs to keep

        def note(*_):
            self.interrupted = True

        signal.signal(signal.SIGINT, note)
        self.deferring = True

    def raise_deferred(self) -> None:
        """The step's tasks are over: Ctrl-C acts again, and one that came while
        deferred is raised now (the step is done: it counts)."""
        if self.deferring:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.deferring = False
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    # ---- on a GPU -----------------------------------------------------------------------
    def state_in(self, task: Task) -> None:
        """OPT_IN: the pack's parameters, gradients and optimizer state to the GPU."""
        started = time.perf_counter()
        opt = self.ctx.optimizers[(task.pack, 0)]
        params = optimizer_params(opt) if opt is not None else []
        state = [opt.state.get(p, {}) for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        moving = params + grads + [v for s in state for v in s.values() if _moves(v)]
        size = sum(t.numel() * t.element_size() for t in moving)
        self.reserve(task.io["dst"], size)
        # a blocking copy: once this task ends, another may write the host copy
        copies = iter(
            self.to_device(
                self.backends[task.device],
                moving,
                [t.dtype for t in moving],
                fresh=True,
                non_blocking=False,
            )
        )
        on_device = [next(copies) for _ in params]
        for p, d in zip(params, on_device):
            if p.grad is not None:
                d.grad = next(copies)
        device_state = [
            {k: next(copies) if _moves(v) else _kept(v) for k, v in s.items()} for s in state
        ]
        self.put(task.io["dst"], PackState(on_device, device_state))
        self._moved(task, size, started)
        if opt is not None:
            self._write(task.pack, self.commits.read(task.pack))

    def device_update(self, task: Task) -> None:
        """UPD on a GPU: the optimizer's step over the tensors the OPT_IN brought."""
        opt = self.ctx.optimizers[(task.pack, 0)]
        if opt is None:
            return
        brought = next(
            self.graph.tasks[d] for d in task.deps if self.graph.tasks[d].kind == OPT_IN
        )
        held: PackState = self.store[brought.io["dst"]]
        twin = device_optimizer(opt, held.params, held.state)
        check_finite_gradients(twin, task.layers)
        twin.step()
        held.state = [twin.state.get(p, {}) for p in held.params]

    def state_out(self, task: Task) -> None:
        """OPT_OUT: the updated parameters and state back to the host."""
        started = time.perf_counter()
        held: PackState = self.store[task.io["src"][0]]
        moving = held.params + [v for s in held.state for v in s.values() if _moves(v)]
        copies = iter(self.to_host(self.backends[task.device], moving, non_blocking=False))
        params = [next(copies) for _ in held.params]
        state = [{k: next(copies) if _moves(v) else v for k, v in s.items()} for s in held.state]
        self._moved(task, sum(t.numel() * t.element_size() for t in moving), started)
        if self.ctx.optimizers[(task.pack, 0)] is not None:
            result = PackState(params, state)
            self._write(task.pack, self.commits.stepped(task.pack, task.data.shard[0], result))

    def _write(self, pack: int, result: PackState | None) -> None:
        """The host copy of ``pack``'s parameters and optimizer state becomes ``result``
        (journaled while other tasks may still fail), and its gradients are dropped."""
        if result is None:
            return
        key = (pack, 0)
        opt = self.ctx.optimizers[key]
        journal = self._journal()
        if journal is not None:
            journal.record(key, opt)
        params = optimizer_params(opt)
        with torch.no_grad():
            for p, new, state in zip(params, result.params, result.state):
                p.copy_(new)
                old = opt.state.get(p)
                if not old:
                    opt.state[p] = {k: _kept(v) for k, v in state.items()}
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and isinstance(old.get(k), torch.Tensor):
                        old[k].copy_(v)  # in place: an optimizer may hold views of its state
                    else:
                        old[k] = _kept(v)
        opt.zero_grad(set_to_none=True)
