"""What a step's transfer tasks do: weights, data, activations and gradients moved.

:class:`Transfers` is the part of :class:`~harmony.engine.step.run.StepRun` that
copies a pack's weights to its GPU (W_IN), the minibatch (DATA_IN), stashed
inputs and offloaded activations out and back (STASH_*, ACT_*), activations
between GPUs (P2P), and gradients to the host (G_OUT), where they are summed
into each parameter's ``.grad`` (on a device that computes on host memory, the
first is the tensor autograd made, not a copy of it); with the plan's
``gpu_gradients`` the sums stay on the GPUs (G_IN, REDUCE: see :mod:`.accumulators`).
"""

from __future__ import annotations

import threading
import time

import torch

from ...graph import Task, TaskGraph, TiedGradients
from ...plan import layer_shard
from ..buffers import copy_runs
from ..context import StepContext
from .accumulators import Accumulators
from .casts import land
from .compute import BufferVersions
from .disk import DiskSteps
from .memory import StepMemory, assemble
from .ties import TieSums


class Transfers:
    """Owns the gradients' lock, the ties' sums and the GPUs' accumulators.

    Given the step's ``ctx`` and ``graph``, the minibatch (``inputs``,
    ``target``), its ``memory`` (buffers, copies), ``moved``
    (:meth:`~.memory.BytesMoved.count`), ``disk`` (master weights and stashes
    read from the disk tier), ``versions`` (which BatchNorm statistics a weight
    load brought) and ``on_host`` ((kind, layer) -> pieces sent to host memory,
    shared with ``disk``, which writes the spilled ones)."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        inputs: tuple,
        target: torch.Tensor,
        memory: StepMemory,
        moved,
        disk: DiskSteps,
        versions: BufferVersions,
        on_host: dict[tuple, list],
    ):
        self.ctx, self.graph, self.inputs, self.target = ctx, graph, inputs, target
        self.on_host, self.lock, self._moved = on_host, memory.lock, moved
        self.backends, self.store = memory.backends, memory.store
        self.reserve, self.put, self.pieces = memory.reserve, memory.put, memory.pieces
        self.to_device, self.to_host, self._copy = memory.to_device, memory.to_host, memory._copy
        self.wire_dtype = memory.wire_dtype
        self.note_loaded = versions.note_loaded
        self.spilled, self.stash_read = disk.spilled, disk.stash_read
        self.loaded_weights, self.weights_copied = disk.loaded_weights, disk.weights_copied
        self.hold_loaded_weights = disk.hold_loaded_weights
        self.grads_lock = threading.Lock()
        # the graph sends the gradients of parameters tied across packs per microbatch
        self.splits_ties = any(isinstance(t.data, TiedGradients) for t in graph.tasks)
        self.ties = (
            TieSums(ctx.host, graph, self.grads_lock, memory.gradient_buffer)
            if self.splits_ties
            else None
        )
        self.gradient_buffer = memory.gradient_buffer
        # gradient sums kept on the GPUs (the plan's option)
        gpu_sums = ctx.plan.option("gpu_gradients")
        self.accumulators = Accumulators(graph) if gpu_sums else None

    def weights_in(self, task: Task) -> None:
        s, e = task.layers
        backend = self.backends[task.device]
        backward = "grads" in task.io
        started = time.perf_counter()
        entries, aliases = self._entries(s, e)
        # under mixed precision, BatchNorm's parameters and statistics keep their dtype
        dtypes = [
            t.dtype if name in self.ctx.norm_tensors[i] else self.wire_dtype(t)
            for i, name, t, _ in entries
        ]
        sizes = [t.numel() * d.itemsize for (_, _, t, _), d in zip(entries, dtypes)]
        loaded, from_disk = self._read_from_disk(task, entries)
        self.reserve(task.io["weights"], sum(sizes))
        split = (
            {id(p) for _, _, p in self.ctx.host.split_ties(s, e)} if self.splits_ties else set()
        )
        if backward:
            self.reserve(
                task.io["grads"],
                sum(
                    n
                    for (_, _, t, is_param), n in zip(entries, sizes)
                    if is_param and t.requires_grad and id(t) not in split
                ),
            )
        # read before the copy: a write-back during it shows as a newer version
        self.note_loaded(task.io["weights"], s, e)
        sources = [loaded.get(id(t), t) for _, _, t, _ in entries]
        if loaded and not backend.copies and all(d == t.dtype for d, t in zip(dtypes, sources)):
            # a device that computes on host memory uses the weights where the disk tier
            # read them; the staging goes back when the graph frees the weights
            device = [t.detach() for t in sources]
            self.hold_loaded_weights(task)
        else:
            # from staging: copied before the staging is given back, into new memory (a
            # pool keeps a buffer per copy of the step: the model's weights, which the disk
            # tier keeps out of host memory); a device that computes on host memory uses
            # weights its update staged where they are (the update follows the backward)
            device = self.to_device(
                backend,
                sources,
                dtypes,
                fresh=bool(loaded),
                non_blocking=not from_disk,
                pooled=not from_disk,
                keep=not loaded,
            )
            if loaded:
                self.weights_copied(task)
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
            self._put_leaves(task, entries, weights, split)

    def _entries(self, s: int, e: int) -> tuple[list, list]:
        """The host tensors of layers [s, e) to load, (layer, name, tensor, is a
        parameter), and the aliases, (layer, name, (layer, name) of the first use): a
        tensor that several layers of the pack share crosses once, and they share its
        copy (so autograd sums their gradients as it does in the model)."""
        entries, aliases, first = [], [], {}
        for i in range(s, e):
            for is_param, tensors in (
                (True, self.ctx.host.params[i]),
                (False, self.ctx.host.buffers[i]),
            ):
                for name, t in tensors.items():
                    if id(t) in first:
                        aliases.append((i, name, first[id(t)]))
                    else:
                        first[id(t)] = (i, name)
                        entries.append((i, name, t, is_param))
        return entries, aliases

    def _read_from_disk(self, task: Task, entries: list) -> tuple[dict, bool]:
        """Master weights on a disk tier, read by the DISK_INs this load depends on
        (or, for a backward load, by its update's: the parameters are the staged
        weights): id(parameter) -> what was read, and whether any is on the tier."""
        if self.ctx.disk is None:
            return {}, False
        loaded = self.loaded_weights(task)
        from_disk = False
        for _, _, t, is_param in entries:
            if is_param:
                self.ctx.disk.check_weights_read(t, loaded)
                from_disk = from_disk or id(t) in self.ctx.disk.on_disk
        return loaded, from_disk

    def _put_leaves(self, task: Task, entries: list, weights: dict, split: set) -> None:
        """The gradients this group accumulates: a shared tensor's under its first
        name only, a split tie's not at all (it leaves per microbatch)."""
        s, e = task.layers
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
        value = self.stash_read(task)  # read back from the disk tier, or in host memory
        if value is None and kind == "stash" and layer == 0:
            value = tuple(t[a:b] for t in self.inputs)
        elif value is None:
            with self.lock:
                pieces = [p for p in self.on_host[(kind, layer)] if p[0][0] < b and a < p[0][1]]
            value = assemble(pieces, a, b)
        # into memory freed with the graph's buffer, not a pool (which keeps a buffer
        # per copy until the step ends): stashes come back through the whole backward
        # pass, and with stashes on disk host memory holds a few at once
        self.put(task.io["dst"], self._copy(task, value, to_device=True, pooled=False))

    def host_out(self, task: Task) -> None:
        kind, layer, (a, b) = task.data.what, task.data.layer, task.data.samples
        value = assemble(self.pieces(task.io["src"]), a, b)
        # a piece the disk tier writes and lets go: memory of its own, not the pool's
        # (whose buffers go back when the step ends)
        out = self._copy(task, value, to_device=False, pooled=task.id not in self.spilled)
        with self.lock:
            self.on_host[(kind, layer)].append(((a, b), out))

    def peer_in(self, task: Task) -> None:
        a, b = task.data.samples
        value = assemble(self.pieces(task.io["src"]), a, b)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def reduce(self, task: Task) -> None:
        """One GPU's share of a reduce-scatter: its bytes cross the peer link here;
        the sums themselves are formed, in GPU order, when each shard goes out. With
        gradient sums on the GPUs, its share of an all-reduce of the accumulators."""
        started = time.perf_counter()
        if self.accumulators is not None:
            self.accumulators.all_reduce(task, self.store)
        self._moved(task, task.nbytes, started)

    def grads_out(self, task: Task) -> None:
        """A pack's gradient (data parallel: one shard, summed over the GPUs in
        order) into the host copy's ``.grad``: added to it, or with gradient sums
        on the GPUs, the sum of every microbatch in place of it."""
        if isinstance(task.data, TiedGradients):
            self.tied_out(task)
            return
        if self.accumulators is not None and not self.accumulators.is_final(task):
            self.swap_out(task)
            return
        (s, e), (r, k) = task.data.layers, task.data.shard
        started = time.perf_counter()
        replicas = [self.store[b] for b in task.io["src"]]
        sums = []  # (host parameter, gradient on the device)
        adopt = []  # (leaf, host parameter): see _adoptable
        for i in layer_shard((s, e), r, k):
            for name in replicas[0][i]:
                grads = [rep[i][name].grad for rep in replicas if rep[i][name].grad is not None]
                if not grads:
                    continue
                g = grads[0]
                for other in grads[1:]:  # the replicas' sum, formed in GPU order
                    g = g + other.to(g.device, non_blocking=True)
                host = self.ctx.host.params[i][name]
                if len(replicas) == 1 and self._adoptable(task, host, g):
                    adopt.append((replicas[0][i][name], host))
                sums.append((host, g))
        # Several GPUs may send gradients of the same parameters at once (each its
        # microbatches' share): whether a gradient is the step's first or is added,
        # and the write itself, happen under one lock, copies complete.
        replace = self.accumulators is not None
        with self.grads_lock:
            for leaf, host in adopt:
                if host.grad is None:
                    host.grad, leaf.grad = leaf.grad, None  # the leaf goes with the buffer
            first, more = [], []
            for host, g in sums:
                if host.grad is g:
                    continue
                if host.grad is None or replace:
                    if host.grad is None:  # memory kept from step to step (float32 under
                        host.grad = self.gradient_buffer(host)  # mixed precision)
                    first.append((host.grad, g))
                else:
                    more.append((host.grad, g))
            land(copy_runs(first))  # cast on the GPU, one wait (see .casts)
            for dst, src in more:
                if src.device != dst.device:  # added on the host, after a copy there
                    src = self.to_host(self.backends[task.device], [src], non_blocking=False)[0]
                dst.add_(src)
        self._moved(task, sum(g.numel() * g.element_size() for _, g in sums), started)

    def _adoptable(self, task: Task, host: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether the gradient ``g`` of host parameter ``host`` can become its ``.grad``
        as it is, where it would otherwise be copied into a host buffer: on a device
        that computes on host memory (autograd made ``g`` there, for this step alone),
        in the parameter's dtype and shape, summed on the host (no running sum on a
        GPU) and not into a gradient slot (whose buffers the step shares out). The
        copy would cost a pass over the pack's gradients every step."""
        slots = self.ctx.gradient_slots
        return (
            not self.backends[task.device].copies
            and self.accumulators is None
            and g.device == host.device
            and g.dtype == host.dtype
            and g.shape == host.shape
            and (slots is None or not slots.holds(host))
        )

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

    def swap_out(self, task: Task) -> None:
        """G_OUT of a running sum on the GPU: to its GPU's slot in host memory."""
        started = time.perf_counter()
        leaves = self.store[task.io["src"][0]]
        keys = [
            (i, name) for i in leaves for name in leaves[i] if leaves[i][name].grad is not None
        ]
        grads = [leaves[i][name].grad for i, name in keys]
        host = self.to_host(self.backends[task.device], grads, non_blocking=False)
        self.accumulators.slots[(task.device, task.pack)] = dict(zip(keys, host))
        self._moved(task, sum(g.numel() * g.element_size() for g in grads), started)

    def grads_in(self, task: Task) -> None:
        """G_IN: the running sum back from host memory into the group's gradients,
        for its backward to add one more microbatch to (as autograd accumulates)."""
        started = time.perf_counter()
        leaves = self.store[task.io["grads"]]
        slot = self.accumulators.slots[(task.device, task.pack)]
        targets = [leaves[i][name] for i, name in slot]
        sums = self.to_device(
            self.backends[task.device], list(slot.values()), [t.dtype for t in targets]
        )
        for leaf, g in zip(targets, sums):
            leaf.grad = g
        self._moved(task, sum(g.numel() * g.element_size() for g in sums), started)
