"""What a step's disk tasks do: state between the disk tier and host memory.

:class:`DiskSteps` is the part of :class:`~harmony.engine.step.run.StepRun` that
plays DISK_IN and DISK_OUT (payload :class:`~harmony.graph.DiskState`; see
:mod:`harmony.policies.disk_tier` for where the graph puts them) with the
run's :class:`~harmony.engine.disk_staging.StateOnDisk`:

* a DISK_IN before an update (UPD) reads the kinds of that update's unit into
  a staging slot; the parameters' data and the optimizer's state are then the
  slot's, and the UPD steps them in place;
* the DISK_OUT after it writes them back (the tier's next slot, committed with
  the step) and gives the staging slot up;
* a backward weight load (W_IN) of a pack whose update reads its master
  weights (the placement's ``weights_with_update``) depends on that read
  too, and copies from the parameters, which are the staged weights then;
* a DISK_IN before a weight load (W_IN) reads the master weights of its packs;
  the W_IN copies from them (:meth:`DiskSteps.loaded_weights`) and gives them
  back (:meth:`DiskSteps.weights_copied`), or, on a device that computes on
  host memory (the cpu backend), uses them in place and gives them back when
  the graph frees the weights (:meth:`DiskSteps.buffer_freed`).

* where the placement puts the stashes on disk too (``stashes_on_disk``), a
  DISK_OUT after a transfer to host memory (STASH_OUT, ACT_OUT; payload
  :class:`~harmony.graph.Activation`) writes the piece it brought to the
  tier's :class:`~harmony.engine.tiers.stashes.StashFile` and lets it go (the
  transfer put it in memory of its own, not the host pool's, so it is freed
  then); a DISK_IN before a transfer back reads the samples it needs into new
  memory, which the transfer takes (:meth:`DiskSteps.stash_read`).

Bytes are counted per task as the graph counts them (state tensors, not the
0-dim step counters). The disk is paced by the tier itself (its ``read_rate``
and ``write_rate``: the engine's emulated disk link), not by the step's pacer.
If the step fails, :meth:`DiskSteps.disk_roll_back` forgets what is staged,
unwritten: the tier's committed slot is the state as before the step.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable

from ...graph import (
    ACT_IN,
    DISK_IN,
    DISK_OUT,
    STASH_IN,
    W_IN,
    Activation,
    Task,
    TaskGraph,
    is_load_read,
)
from ..context import StepContext
from ..disk_staging import Staged, Unit
from .memory import assemble, nbytes


class DiskSteps:
    """Owns what the step has staged from the disk tier and what it wrote there.

    Given the step's ``ctx`` and ``graph``, its ``lock``, ``on_host`` (the values
    the transfers sent to host memory, (kind, layer) -> pieces, of which it
    writes the spilled ones) and ``moved`` (:meth:`~.memory.BytesMoved.count`).
    Its bookkeeping: what each DISK_IN serves, what is staged."""

    def __init__(
        self,
        ctx: StepContext,
        graph: TaskGraph,
        lock: threading.Lock,
        on_host: dict[tuple, list],
        moved: Callable,
    ):
        self.ctx, self.graph, self.lock = ctx, graph, lock
        self.on_host, self._moved = on_host, moved
        self.disk_units: dict[tuple[int, int], tuple[Unit, tuple[str, ...], Staged]] = {}
        self.disk_loads: dict[int, tuple[dict, Staged]] = {}  # DISK_IN id -> what it read
        self.loads_for: dict[int, list[int]] = {}  # W_IN id -> its DISK_INs
        self.feeds_load: set[int] = set()  # the DISK_INs that read for a W_IN
        # weights buffer -> the loads a device computing on host memory uses in place
        self.held_loads: dict[int, list[Staged]] = {}
        # stashes on disk: the transfers to host memory whose pieces are written there,
        # what each (kind, layer) has there (samples -> where), the transfer back each
        # DISK_IN reads for, and what it read
        self.spilled: set[int] = set()
        self.stashes_on_disk: dict[tuple[str, int], list] = defaultdict(list)
        self.stash_reads: dict[int, tuple] = {}  # transfer back id -> the value read
        if self.ctx.disk is None:
            return
        tasks = self.graph.tasks
        for t in tasks:
            if t.kind == W_IN:
                reads = [d for d in t.deps if is_load_read(tasks[d])]
                if reads:
                    self.loads_for[t.id] = reads
            elif t.kind == DISK_OUT and isinstance(t.data, Activation):
                self.spilled.update(t.deps)
        self.feeds_load = {d for reads in self.loads_for.values() for d in reads}
        self.reads_for = {  # a stash's DISK_IN -> the transfer back it reads for
            d: t.id
            for t in tasks
            if t.kind in (STASH_IN, ACT_IN)
            for d in t.deps
            if tasks[d].kind == DISK_IN and isinstance(tasks[d].data, Activation)
        }
        if self.ctx.disk.stashes is not None:
            self.ctx.disk.stashes.new_step()

    def disk_in(self, task: Task) -> None:
        started = time.perf_counter()
        disk, data = self.ctx.disk, task.data
        if isinstance(data, Activation):
            self._moved(task, self.read_stash(task), started, pace=False)
            return
        if task.id in self.feeds_load:
            values, staged = disk.load(data.packs)
            with self.lock:
                self.disk_loads[task.id] = (values, staged)
        else:
            key = (data.packs[0], data.shard[0])
            unit = disk.units[key]
            staged = disk.stage(unit, data.kinds)
            with self.lock:
                self.disk_units[key] = (unit, data.kinds, staged)
        self._moved(task, staged.nbytes, started, pace=False)

    def disk_out(self, task: Task) -> None:
        started = time.perf_counter()
        if isinstance(task.data, Activation):
            self._moved(task, self.write_stash(task), started, pace=False)
            return
        key = (task.data.packs[0], task.data.shard[0])
        with self.lock:
            unit, kinds, staged = self.disk_units.pop(key)
        self._moved(task, self.ctx.disk.unstage(unit, kinds, staged), started, pace=False)

    def write_stash(self, task: Task) -> int:
        """Write the piece of a stash (or offloaded activation) the transfer before
        ``task`` brought to host memory, and let it go; its bytes."""
        kind, layer, samples = task.data.what, task.data.layer, task.data.samples
        with self.lock:
            held = self.on_host[(kind, layer)]
            (i,) = [i for i, (s, _) in enumerate(held) if s == samples]
            _, value = held.pop(i)
        where = self.ctx.disk.stashes.write(value)
        with self.lock:
            self.stashes_on_disk[(kind, layer)].append((samples, where))
        return nbytes(value)

    def read_stash(self, task: Task) -> int:
        """Read the samples of a stash (or offloaded activation) that the transfer
        back after ``task`` needs; its bytes."""
        kind, layer, (a, b) = task.data.what, task.data.layer, task.data.samples
        with self.lock:
            written = list(self.stashes_on_disk[(kind, layer)])
        pieces = [p for p in written if p[0][0] < b and a < p[0][1]]
        parts = []
        for (lo, hi), where in pieces:
            s, e = max(a, lo), min(b, hi)
            parts.append(((s, e), self.ctx.disk.stashes.read(where, (s - lo, e - lo))))
        value = assemble(parts, a, b)
        with self.lock:
            self.stash_reads[self.reads_for[task.id]] = value
        return nbytes(value)

    def stash_read(self, task: Task) -> tuple | None:
        """What the DISK_IN before the transfer back ``task`` read (None: its value
        is in host memory); it is the transfer's to copy."""
        with self.lock:
            return self.stash_reads.pop(task.id, None)

    def loaded_weights(self, task: Task) -> dict:
        """id(parameter) -> master weight read from disk for the weight load ``task``."""
        values: dict = {}
        with self.lock:
            for d in self.loads_for.get(task.id, ()):
                values.update(self.disk_loads[d][0])
        return values

    def weights_copied(self, task: Task) -> None:
        """The weight load ``task`` has copied what its DISK_INs read: give it back."""
        for d in self.loads_for.get(task.id, ()):
            with self.lock:
                _, staged = self.disk_loads.pop(d)
            self.ctx.disk.loaded(staged)

    def hold_loaded_weights(self, task: Task) -> None:
        """The weight load ``task`` uses what its DISK_INs read in place: keep it
        until the graph frees the weights (:meth:`buffer_freed`)."""
        held = []
        for d in self.loads_for.get(task.id, ()):
            with self.lock:
                held.append(self.disk_loads.pop(d)[1])
        with self.lock:
            self.held_loads[task.io["weights"]] = held

    def buffer_freed(self, buf: int) -> None:
        """The graph has freed ``buf``: give back the loads it used in place."""
        with self.lock:
            held = self.held_loads.pop(buf, ())
        for staged in held:
            self.ctx.disk.loaded(staged)

    def disk_roll_back(self) -> None:
        """A failed step: what is staged is forgotten, unwritten, and the tier's
        writes of this step are discarded (its committed slots are the undo copy)."""
        if self.ctx.disk is None:
            return
        with self.lock:
            units, self.disk_units = self.disk_units, {}
            loads, self.disk_loads = self.disk_loads, {}
            held, self.held_loads = self.held_loads, {}
            self.stash_reads.clear()
        for unit, kinds, staged in units.values():
            self.ctx.disk.give_up(unit, kinds, staged)
        for staged in [s for _, s in loads.values()] + [s for ss in held.values() for s in ss]:
            self.ctx.disk.loaded(staged)
        self.ctx.disk.tier.discard()
