"""The training state a run keeps on a disk tier: :class:`StateOnDisk`.

The task graph's placement (``graph.info["disk"]``, :mod:`harmony.policies.disk_tier`)
says which kinds of each backward pack live on disk: ``"optimizer"`` (the
optimizer's state), then ``"weights"`` (the master weights). The engine keeps
them per *unit*, one update's parameters (a backward pack, or a shard of it
in data parallel: the engine's optimizer keys), one tier file per (unit,
kind), named as :func:`~harmony.engine.tiers.pack_name` names ``q`` or
``(q, r)``.

Between the steps that use it, such state is not in host memory: a master
weight on disk is a *placeholder* (the parameter object, with its shape,
whose data is one element broadcast: an in-place write to it raises, so a
task that would use it without reading it first fails loudly), and an
optimizer on disk holds no state. A read puts a unit's kinds in one staging
slot (host memory charged to the :class:`~harmony.engine.tiers.HostBudget`):
the parameters' data become views of it and the optimizer adopts its state
as it is (:class:`~harmony.engine.optim.FlatAdamW` and torch's optimizers
step it in place); the write sends them back and gives the slot up. A weight
load (W_IN) reads its packs' weights into a slot of its own and copies from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import HarmonyError
from .journal import optimizer_params
from .tiers import DiskTier, HostBudget, Placement, adopt_state, drop_state, export_state
from .tiers.files import ALIGN, round_up
from .tiers.stashes import StashFile


@dataclass
class Unit:
    """The state of one update that lives on disk: its tier key, optimizer,
    parameters (by name, in the optimizer's order) and kinds on disk."""

    key: int | tuple[int, int]
    opt: torch.optim.Optimizer
    params: list[tuple[str, nn.Parameter]]
    kinds: tuple[str, ...]


@dataclass
class Staged:
    """What a read holds until it is written back or given up: its slot, and
    the bytes it moved (state tensors; 0-dim step counters are not counted,
    as no transfer counts them)."""

    slot: torch.Tensor | None
    nbytes: int
    tensors: dict[str, dict[str, torch.Tensor]]  # kind -> name -> view of the slot


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """``p``'s shape and dtype, none of its memory (see the module docstring)."""
    return torch.zeros((), dtype=p.dtype).expand(p.shape)


def has_memory(p: torch.Tensor) -> bool:
    """Whether ``p`` has memory of its own for every element (not a meta tensor
    nor a placeholder)."""
    return not p.is_meta and p.untyped_storage().nbytes() >= p.numel() * p.element_size()


class Slots:
    """Host buffers that staged state is read into, charged to the budget, each
    the size of the read it serves. A buffer given back is kept for the next
    read of its size (the blocks of a transformer: memory already in use, not
    fresh pages to fault in); a read of another size first gives every kept
    buffer back, so the slots never hold more than the reads held at once."""

    def __init__(self, budget: HostBudget, name: str):
        self.budget, self.name = budget, name
        self._free: list[tuple[str, torch.Tensor]] = []  # kept for a read of their size
        self._held: dict[int, str] = {}  # id(buffer) -> its name in the ledger
        self._made = 0
        self._lock = threading.Lock()
        self.nbytes = 0  # what the buffers take, held and kept
        self.peak = 0  # the most they ever took at once

    def take(self, nbytes: int) -> torch.Tensor:
        if not nbytes:  # nothing on disk yet (the optimizer makes its state in the update)
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            for i, (name, slot) in enumerate(self._free):
                if slot.numel() == nbytes:
                    del self._free[i]
                    self._held[id(slot)] = name
                    return slot
            name = f"{self.name} {self._made}"
            self._made += 1
        self.trim()  # their memory goes back before the new buffer is made
        slot = self.budget.empty(name, nbytes, torch.uint8)
        with self._lock:
            self._held[id(slot)] = name
            self.nbytes += nbytes
            self.peak = max(self.peak, self.nbytes)
        return slot

    def give(self, slot: torch.Tensor) -> None:
        if slot.numel():
            with self._lock:
                self._free.append((self._held.pop(id(slot)), slot))

    def trim(self) -> None:
        """Give back the buffers kept for reads to come (those held stay)."""
        with self._lock:
            dropped, self._free = self._free, []
            self.nbytes -= sum(t.numel() for _, t in dropped)
        for name, _ in dropped:
            self.budget.release(name)

    def close(self) -> None:
        with self._lock:
            names = [n for n, _ in self._free] + list(self._held.values())
            self._free, self._held, self.nbytes = [], {}, 0
        for name in names:
            self.budget.release(name)


class StateOnDisk:
    """A run's state on a :class:`~harmony.engine.tiers.DiskTier` (see the module
    docstring). ``units``: (pack, shard) -> :class:`Unit`, those with a kind on
    disk."""

    def __init__(
        self,
        tier: DiskTier,
        placement: Placement,
        units: dict[tuple[int, int], Unit],
        budget: HostBudget,
    ):
        self.tier, self.placement, self.units = tier, placement, units
        self.on_disk = {  # id(master weight on disk) -> its unit
            id(p): u for u in units.values() if "weights" in u.kinds for _, p in u.params
        }
        self.update_slots = Slots(budget, "disk tier staging for updates")
        self.load_slots = Slots(budget, "disk tier staging for weight loads")
        #: the step's stashes, where the placement puts them on disk too
        self.stashes = StashFile(tier.io, tier.directory) if placement.stashes_on_disk else None

    # ---- moving state between memory and the tier -------------------------------------
    def _load_units(self, packs: tuple[int, ...]) -> list[Unit]:
        """The units whose master weights on disk a load of backward ``packs`` reads."""
        return [
            u for (q, _), u in sorted(self.units.items()) if q in packs and "weights" in u.kinds
        ]

    def write(self, unit: Unit, kinds: tuple[str, ...], release: bool) -> int:
        """Write ``unit``'s ``kinds`` from memory to the tier (an optimizer without
        state writes nothing); with ``release``, then leave them on disk only.
        Returns the bytes written."""
        moved = 0
        for kind in kinds:
            tensors = _weights(unit) if kind == "weights" else export_state(unit.opt)
            if tensors:
                self.tier.write(unit.key, kind, tensors)
                moved += sum(_counted(t) for t in tensors.values())
        if release:
            self.forget(unit, kinds)
        return moved

    def forget(self, unit: Unit, kinds: tuple[str, ...]) -> None:
        """``unit``'s ``kinds`` leave host memory (on disk, they are the tier's)."""
        if "weights" in kinds:
            for _, p in unit.params:
                p.data = placeholder(p)
        if "optimizer" in kinds:
            drop_state(unit.opt)

    def stage(self, unit: Unit, kinds: tuple[str, ...]) -> Staged:
        """Read ``unit``'s ``kinds`` into a slot and make them its parameters' data
        and its optimizer's state (an optimizer state not written yet: none, the
        update makes it)."""
        staged = self._read([(unit, k) for k in kinds], self.update_slots)
        with torch.no_grad():
            for name, p in unit.params if "weights" in kinds else ():
                p.data = staged.tensors["weights"][f"{unit.key}/{name}"]
        if "optimizer" in staged.tensors:
            state = staged.tensors["optimizer"].items()
            adopt_state(unit.opt, {k.split("/", 1)[1]: v for k, v in state})
        return staged

    def unstage(self, unit: Unit, kinds: tuple[str, ...], staged: Staged) -> int:
        """Write back what :meth:`stage` read (now updated) and give its slot up."""
        try:
            return self.write(unit, kinds, release=True)
        finally:
            self.update_slots.give(staged.slot)

    def give_up(self, unit: Unit, kinds: tuple[str, ...], staged: Staged) -> None:
        """A failed step: forget what :meth:`stage` read, unwritten."""
        self.forget(unit, kinds)
        self.update_slots.give(staged.slot)

    def loaded(self, staged: Staged) -> None:
        """A weight load has copied what :meth:`load` read: its slot goes back."""
        self.load_slots.give(staged.slot)

    def load(self, packs: tuple[int, ...]) -> tuple[dict[int, torch.Tensor], Staged]:
        """The master weights on disk of backward ``packs`` (every shard), read for
        a weight load: id(parameter) -> its staged value."""
        units = self._load_units(packs)
        staged = self._read([(u, "weights") for u in units], self.load_slots)
        read = staged.tensors.get("weights", {})
        values = {id(p): read[f"{u.key}/{name}"] for u in units for name, p in u.params}
        return values, staged

    def _read(self, what: list[tuple[Unit, str]], slots: Slots) -> Staged:
        """Read the (unit, kind) files of ``what`` that exist into one slot of ``slots``."""
        what = [(u, k) for u, k in what if self.tier.has(u.key, k)]
        layouts = [self.tier.layout(u.key, k) for u, k in what]
        slot = slots.take(sum(round_up(size, ALIGN) for _, size in layouts))
        staged, at = Staged(slot, 0, {}), 0
        try:
            for (unit, kind), (entries, size) in zip(what, layouts):
                views = {
                    e.name: slot[at + e.offset : at + e.offset + e.nbytes]
                    .view(e.torch_dtype)
                    .view(e.shape)
                    for e in entries
                }
                self.tier.read(unit.key, kind, into=views)
                at += round_up(size, ALIGN)
                staged.nbytes += sum(_counted(v) for v in views.values())
                named = {f"{unit.key}/{k}": v for k, v in views.items()}
                staged.tensors.setdefault(kind, {}).update(named)
        except BaseException:
            slots.give(slot)
            raise
        return staged

    def read_all(
        self, names: dict[int, str], kinds: tuple[str, ...] = ("weights", "optimizer")
    ) -> tuple[dict, dict]:
        """Copies of everything of ``kinds`` on disk: (parameter name -> master
        weight, parameter name -> optimizer state), for a whole state dict."""
        # between steps: what staging keeps for the next step's reads makes room for the copies
        self.update_slots.trim()
        self.load_slots.trim()
        weights, state = {}, {}
        for unit in self.units.values():
            wanted = [(unit, kind) for kind in unit.kinds if kind in kinds]
            if not wanted:
                continue
            staged = self._read(wanted, self.update_slots)
            try:
                got = staged.tensors
                for key, value in got.get("weights", {}).items():
                    weights[key.split("/", 1)[1]] = value.clone()
                params = optimizer_params(unit.opt)
                for key, value in got.get("optimizer", {}).items():
                    index, _, field = key.split("/", 1)[1].partition(".")
                    state.setdefault(names[id(params[int(index)])], {})[field] = value.clone()
            finally:
                self.update_slots.give(staged.slot)
        return weights, state

    def check_weights_read(self, p: torch.Tensor, loaded: dict[int, torch.Tensor]) -> None:
        """A weight load of ``p``, which lives on disk, has read it first: for the
        load (``loaded``), or for its update (staged: its data is the slot's)."""
        if id(p) in self.on_disk and id(p) not in loaded and not has_memory(p):
            raise HarmonyError(
                "a weight load needs master weights that live on the disk tier, and the graph "
                "reads none for it (a DISK_IN before the W_IN): the graph and the placement "
                "disagree"
            )

    def close(self) -> None:
        self.update_slots.close()
        self.load_slots.close()
        if self.stashes is not None:
            self.stashes.close()
        self.tier.close()


def _weights(unit: Unit) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in unit.params}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _counted(t: torch.Tensor) -> int:
    return _nbytes(t) if t.dim() else 0
