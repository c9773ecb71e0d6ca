"""What a step's compute tasks do: FWD, REC, BWD and FWDBWD with real tensors.

:class:`Compute` is the part of :class:`~harmony.engine.step.run.StepRun` that runs
a pack's layers on the weights a W_IN brought (:meth:`~.host_model.HostModel.run`:
the host module or its weightless replica), stashes inputs, recomputes with autograd,
runs backward and the loss, and keeps BatchNorm-like buffers exactly as the
plain loop updates them: once per microbatch (:class:`BufferVersions`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from ...errors import NonFiniteError
from ...graph import FWD, FWDBWD, Task, TaskGraph
from ..context import StepContext
from ..meters import SavedBytes, Unmetered, WorkMeter
from ..reference_loop import as_args, seed_layer
from .memory import StepMemory, assemble, nbytes


@dataclass
class Outcome:
    """What the step's compute found: the loss summed over its microbatches, and why
    this server sends NaN gradients (a non-finite loss across servers; None: none)."""

    loss: float = 0.0
    poisoned: str | None = None


def buffer_writers(ctx: StepContext, graph: TaskGraph) -> dict[int, str] | None:
    """The device whose forward of each layer updates the host copy of its
    buffers (BatchNorm statistics): in a pipeline the one that runs the layer,
    in data parallel the first replica's (every replica saw other samples).
    None: one replica, every forward writes (a 1-GPU plan, wherever it runs)."""
    if ctx.plan.n_gpus == 1:
        return None
    writers: dict[int, str] = {}
    for t in sorted(
        (t for t in graph.tasks if t.kind in (FWD, FWDBWD)),
        key=lambda t: int(t.device[3:]),
    ):
        for i in range(*t.layers):
            writers.setdefault(i, t.device)
    return writers


class BufferVersions:
    """Owns the versions of BatchNorm-like buffers: host copy's, and each weight load's.

    How often each layer's buffers were written back this step, and which
    version each weight load brought: a weight group prefetched before the
    previous forward of its layers wrote back must refresh them. Given the
    step's ``ctx``, ``graph`` and ``lock``."""

    def __init__(self, ctx: StepContext, graph: TaskGraph, lock: threading.Lock):
        self.ctx, self.lock = ctx, lock
        self.writers = buffer_writers(ctx, graph)
        self.buffer_version: dict[int, int] = defaultdict(int)
        self.loaded_version: dict[int, dict[int, int]] = {}

    def note_loaded(self, weights: int, s: int, e: int) -> None:
        """The weight load into buffer ``weights`` of layers [s, e) reads the host copy now."""
        with self.lock:
            self.loaded_version[weights] = {
                i: self.buffer_version[i] for i in range(s, e) if self.ctx.host.buffers[i]
            }

    def write_back(self, task: Task, weights: dict) -> None:
        """BatchNorm-like buffers changed by a real forward go back to the host copy."""
        with torch.no_grad():
            for i in range(*task.layers):
                if self.writers is not None and self.writers[i] != task.device:
                    continue
                for name, b in self.ctx.host.buffers[i].items():
                    b.copy_(weights[i][name])
                if self.ctx.host.buffers[i]:
                    with self.lock:  # the device's copy is in sync
                        self.buffer_version[i] += 1
                        self.loaded_version[task.io["weights"]][i] = self.buffer_version[i]

    def refresh(self, task: Task, weights: dict) -> None:
        """Before a real forward: buffers loaded before an earlier forward of the
        same layers wrote back are brought up to date from the host copy."""
        loaded = self.loaded_version.get(task.io["weights"], {})
        with torch.no_grad():
            for i in range(*task.layers):
                if self.writers is not None and self.writers[i] != task.device:
                    continue  # a replica whose statistics are not kept
                if i in loaded and loaded[i] != self.buffer_version[i]:
                    for name, b in self.ctx.host.buffers[i].items():
                        weights[i][name].copy_(b)
                    loaded[i] = self.buffer_version[i]


@dataclass
class Recomputed:
    """What a REC task leaves its BWD (in its working-memory buffer): the pack's
    input and output with autograd's graph between them, the open meter of the
    tensors autograd saved (closed once backward has used them), and the pack's
    buffers as they were before the recompute (BatchNorm statistics), put back
    after backward so that running statistics count each microbatch once."""

    inputs: tuple
    outputs: tuple
    meter: WorkMeter | Unmetered
    buffers: dict


class Compute:
    """Owns the running of a pack's layers: forward, recompute, backward and the loss.

    Given the step's ``ctx`` and ``graph``, its ``memory`` (buffers, working
    memory meters, mixed precision), ``versions`` (BatchNorm statistics between
    the host copy and the devices), ``outcome`` (the loss and a poisoned
    gradient, written here) and ``parallel_compute`` (several compute threads:
    dropout seeds and draws under the context's lock)."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        memory: StepMemory,
        versions: BufferVersions,
        outcome: Outcome,
        parallel_compute: bool,
    ):
        self.ctx, self.graph, self.outcome = ctx, graph, outcome
        self.parallel_compute = parallel_compute
        self.backends, self.store, self.lock = memory.backends, memory.store, memory.lock
        self.put, self.pieces, self.wire = memory.put, memory.pieces, memory.wire
        self.work_meter, self.autocast = memory.work_meter, memory.autocast
        self._write_back_buffers, self._refresh_buffers = versions.write_back, versions.refresh

    def _run_layers(
        self,
        task: Task,
        weights: dict,
        h: tuple,
        stash: dict | None = None,
        meter: WorkMeter | Unmetered | None = None,
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
                seed = (self.ctx.seed, self.ctx.step, task.samples[0], i, backend.torch_device)
                if not self.parallel_compute:
                    seed_layer(*seed)
                    h = as_args(self.ctx.host.run(gpu, i, weights[i], h))
                elif i in self.ctx.host.random_layers:
                    # several GPUs share the CPU generator: seed and draw without interleaving
                    with self.ctx.rng_lock:
                        seed_layer(*seed)
                        h = as_args(self.ctx.host.run(gpu, i, weights[i], h))
                else:  # draws nothing, so must not reseed under another GPU's dropout
                    h = as_args(self.ctx.host.run(gpu, i, weights[i], h))
                if meter is not None and i < e - 1:
                    n = nbytes(h)
                    meter.charge(n)
                    meter.release(held)
                    held = n
        finally:
            if meter is not None:
                meter.release(held)
        return h

    def forward(self, task: Task) -> None:
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        h = assemble(self.pieces(task.io["input"]), a, b)
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
        h = assemble(self.pieces(task.io[role]), a, b)
        if task.layers[0] > 0:
            h = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in h)
        return h

    def _saved_meter(
        self, task: Task, weights: dict, h: tuple, *more
    ) -> tuple[WorkMeter | Unmetered, SavedBytes | contextlib.nullcontext]:
        """The task's work meter, and the hook that charges it what autograd saves
        (none where the device does not measure: ``Backend.meters_work``)."""
        work = self.work_meter(task)
        if isinstance(work, Unmetered):
            return work, contextlib.nullcontext()
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
            for name in self.ctx.host.buffers[i]
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
            grad_in = assemble(self.pieces(task.io["grad_in"]), a, b)
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
                loss = self.ctx.loss_fn(*out, y) * ((b - a) / self.graph.samples)
            if not torch.isfinite(loss.detach()).all():
                what = f"the loss of samples {a}..{b - 1} is {loss.item()}"
                if self.ctx.sync is None:
                    raise NonFiniteError(what, "loss")
                # Across servers, stopping here would leave the others waiting in the
                # gradient exchange: the step goes on, and this server's updates send
                # NaN, so that every server finds a non-finite gradient at the same pack.
                with self.lock:
                    self.outcome.poisoned = self.outcome.poisoned or what
            (loss * self.ctx.loss_scale if self.ctx.loss_scale != 1.0 else loss).backward()
            with self.lock:
                self.outcome.loss += loss.item()
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
        for i, name, p in self.ctx.host.split_ties(*task.layers):
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
