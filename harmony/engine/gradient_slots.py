"""Host gradients held in a few pack-sized slots instead of one buffer for the
whole model: :class:`GradientSlots`.

Where host memory is short, a plan whose packs' gradients arrive pack after
pack holds them in ``Placement.gradient_slots`` slots (see
:mod:`harmony.policies.disk_tier`): the graph makes the gradients of a pack
wait for the update of the pack that many before it, so when the first
gradient of a pack arrives a slot is free. The pack takes it, its
parameters' ``.grad`` are views of it (laid out update by update, parameter
by parameter, as the optimizers hold them, so a G_OUT still copies in few
large runs), and the last update of the pack gives it back. Slots are kept
from step to step: memory already in use, not fresh pages to fault in.

A parameter tied across packs gets its own buffer for the whole step: its
gradient sums parts from several packs' backward passes, the first long
before its pack's update.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import torch

from ..graph import UPD, TaskGraph
from .journal import optimizer_params


class GradientSlots:
    """The slots, which pack holds which, and the tied parameters' own buffers
    (see the module docstring)."""

    def __init__(
        self,
        slots: int,
        optimizers: dict[tuple[int, int], torch.optim.Optimizer | None],
        packs_of: dict[int, set[int]],
        graph: TaskGraph,
        pin: bool = False,
    ):
        """``slots``: how many; ``optimizers``: (pack, shard) -> optimizer, as the
        engine keeps them; ``packs_of``: id(parameter) -> the backward packs whose
        layers hold it (more than one: tied across packs); ``graph``: the plan's
        task graph (how many updates each pack has)."""
        self.pin = pin
        self._lock = threading.Lock()
        #: id(parameter) -> (pack, dtype, offset in the slot's buffer of that dtype)
        self.where: dict[int, tuple[int, torch.dtype, int]] = {}
        self._tied: dict[int, torch.Tensor | None] = {}
        self._tied_bytes = 0
        used: dict[int, Counter] = defaultdict(Counter)  # pack -> dtype -> elements
        for (q, _), opt in sorted(optimizers.items()):
            for p in optimizer_params(opt) if opt is not None else []:
                if len(packs_of.get(id(p), ())) > 1:
                    if id(p) not in self._tied:
                        self._tied[id(p)] = None
                        self._tied_bytes += p.numel() * p.element_size()
                elif id(p) not in self.where:
                    self.where[id(p)] = (q, p.dtype, used[q][p.dtype])
                    used[q][p.dtype] += p.numel()
        #: elements of each dtype a slot holds: the most any pack needs
        self.size: Counter = Counter()
        for counts in used.values():
            for dtype, n in counts.items():
                self.size[dtype] = max(self.size[dtype], n)
        self.updates = Counter(t.pack for t in graph.tasks if t.kind == UPD)
        self._buffers: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(slots)]
        self._free = list(range(slots))
        self._held: dict[int, int] = {}  # pack -> its slot
        self._done: Counter = Counter()  # pack -> its updates run so far this step
        self.allocations = 0
        self.allocated_bytes = 0

    def __len__(self) -> int:
        """How many slots."""
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Host bytes the slots and the tied parameters' gradients take."""
        slot = sum(n * dtype.itemsize for dtype, n in self.size.items())
        return len(self._buffers) * slot + self._tied_bytes

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.where or id(p) in self._tied

    def buffer(self, p: torch.Tensor) -> torch.Tensor:
        """Where the gradient of host parameter ``p`` lands this step (contents undefined)."""
        with self._lock:
            if id(p) in self._tied:
                if self._tied[id(p)] is None:
                    self._tied[id(p)] = self._new(p.numel(), p.dtype)
                return self._tied[id(p)].view(p.shape)
            q, dtype, offset = self.where[id(p)]
            if q not in self._held:
                if not self._free:  # the graph lets a pack's gradients in only once one is free
                    raise AssertionError(
                        f"gradients of pack {q} arrived while packs {sorted(self._held)} hold "
                        "every gradient slot: the graph's window is missing"
                    )
                self._held[q] = self._free.pop(0)
            slot = self._buffers[self._held[q]]
            if dtype not in slot:
                slot[dtype] = self._new(self.size[dtype], dtype)
            return slot[dtype][offset : offset + p.numel()].view(p.shape)

    def updated(self, pack: int) -> None:
        """An update of ``pack`` has run (its gradients dropped): after its last, the
        slot is free. Every update task says so, those of a shard without gradients
        too (it may run before another shard's gradients take the slot)."""
        with self._lock:
            self._done[pack] += 1
            if self._done[pack] == self.updates[pack]:
                del self._done[pack]
                if pack in self._held:
                    self._free.append(self._held.pop(pack))

    def reset(self) -> None:
        """A failed step: every slot is free again (the gradients were dropped)."""
        with self._lock:
            self._free += self._held.values()
            self._held.clear()
            self._done.clear()

    def _new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += numel * dtype.itemsize
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)


def packs_of_parameters(host, plan) -> dict[int, set[int]]:
    """id(host parameter) -> the backward packs of ``plan`` whose layers hold it."""
    packs: dict[int, set[int]] = defaultdict(set)
    for q, (a, b) in enumerate(plan.bwd_packs):
        for i in range(a, b):
            for p in host.params[i].values():
                packs[id(p)].add(q)
    return packs


def gradient_slots_for(
    placement, host, plan, optimizers, graph: TaskGraph
) -> GradientSlots | None:
    """The slots ``placement`` (a :class:`~harmony.costs.placement.Placement`, or None)
    holds the host gradients of ``host`` in for ``plan``'s ``graph`` (None: none);
    ``optimizers``: (pack, shard) -> optimizer."""
    if placement is None or not placement.gradient_slots:
        return None
    packs = packs_of_parameters(host, plan)
    return GradientSlots(placement.gradient_slots, optimizers, packs, graph, pin=host.layout.pin)
