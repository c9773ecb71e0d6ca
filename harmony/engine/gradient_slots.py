"""Host gradients held a few packs at a time instead of in one buffer for the
whole model: :class:`GradientSlots`.

Where host memory is short, a plan whose packs' gradients arrive pack after
pack holds them in ``Placement.gradient_slots`` (two) slots (see
:mod:`harmony.policies.disk_tier`): the graph makes the gradients of a pack
wait for the updates of the packs before the one before it, so only two
neighbours (in the order their gradients arrive) hold gradients at once.
They share one buffer per dtype, as large as the most two neighbouring packs
need: the packs take its start and its end in turn, so each is clear of its
neighbours and may overlap only packs already updated. A 50k-word embedding
then needs its size and a block's beside it, not two embeddings'. A pack's
parameters' ``.grad`` are views of its part (laid out update by update,
parameter by parameter, as the optimizers hold them, so a G_OUT still copies
in few large runs), and the last update of the pack gives it back. The
buffers are kept from step to step: memory already in use, not fresh pages
to fault in.

A parameter tied across packs gets its own buffer for the whole step: its
gradient sums parts from several packs' backward passes, the first long
before its pack's update.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import torch

from ..costs.placement import most_in_window
from ..graph import G_OUT, UPD, Gradients, TaskGraph
from .journal import optimizer_params


class GradientSlots:
    """The packs' shared buffers, which packs hold their part, and the tied
    parameters' own buffers (see the module docstring)."""

    def __init__(
        self,
        slots: int,
        optimizers: dict[tuple[int, int], torch.optim.Optimizer | None],
        packs_of: dict[int, set[int]],
        graph: TaskGraph,
        pin: bool = False,
    ):
        """``slots``: how many packs hold gradients at once (two: see the module
        docstring); ``optimizers``: (pack, shard) -> optimizer, as the engine keeps
        them; ``packs_of``: id(parameter) -> the backward packs whose layers hold
        it (more than one: tied across packs); ``graph``: the plan's task graph
        (the order the packs' gradients arrive, how many updates each pack has)."""
        if slots != 2:
            raise AssertionError(
                f"packs take a buffer's start and end in turn: 2 slots, not {slots}"
            )
        self.pin = pin
        self._lock = threading.Lock()
        #: id(parameter) -> (pack, dtype, offset in its pack's part)
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
        order = arrival_order(graph)
        if set(used) - set(order):
            raise AssertionError(f"packs {sorted(set(used) - set(order))} get no gradients")
        #: elements of each dtype the shared buffer holds: the most two neighbours need
        self.size: Counter = Counter()
        for dtype in {d for counts in used.values() for d in counts}:
            sizes = [used[q][dtype] for q in order]
            self.size[dtype] = most_in_window(sizes, slots)
        #: pack -> dtype -> where its part starts: the buffer's start and end in turn
        self.start = {
            q: {d: 0 if j % 2 == 0 else self.size[d] - n for d, n in used[q].items()}
            for j, q in enumerate(order)
        }
        #: pack -> the packs next to it in ``order``, which may hold gradients beside it
        self._neighbours = {
            q: set(order[max(0, j - 1) : j + 2]) - {q} for j, q in enumerate(order)
        }
        self.updates = Counter(t.pack for t in graph.tasks if t.kind == UPD)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._held: set[int] = set()  # packs whose gradients are in the buffers
        self._slots = slots
        self._done: Counter = Counter()  # pack -> its updates run so far this step
        self.allocations = 0
        self.allocated_bytes = 0

    def __len__(self) -> int:
        """How many packs hold gradients at once."""
        return self._slots

    @property
    def nbytes(self) -> int:
        """Host bytes the shared buffers and the tied parameters' gradients take."""
        return sum(n * dtype.itemsize for dtype, n in self.size.items()) + self._tied_bytes

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
                # the graph lets a pack's gradients in only once every pack before its
                # neighbours has been updated (a pack may arrive just before the one
                # before it, never before others): the others' parts may overlap its own
                if self._held - self._neighbours[q]:
                    raise AssertionError(
                        f"gradients of pack {q} arrived while packs {sorted(self._held)} hold "
                        "theirs: the graph's window is missing"
                    )
                self._held.add(q)
            if dtype not in self._buffers:
                self._buffers[dtype] = self._new(self.size[dtype], dtype)
            at = self.start[q][dtype] + offset
            return self._buffers[dtype][at : at + p.numel()].view(p.shape)

    def updated(self, pack: int) -> None:
        """An update of ``pack`` has run (its gradients dropped): after its last, its
        part is free. Every update task says so, those of a shard without gradients
        too (it may run before another shard's gradients take the part)."""
        with self._lock:
            self._done[pack] += 1
            if self._done[pack] == self.updates[pack]:
                del self._done[pack]
                self._held.discard(pack)

    def reset(self) -> None:
        """A failed step: every part is free again (the gradients were dropped)."""
        with self._lock:
            self._held.clear()
            self._done.clear()

    def _new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += numel * dtype.itemsize
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)


def arrival_order(graph: TaskGraph) -> list[int]:
    """The backward packs in the order their gradients reach host memory (first G_OUT)."""
    order: list[int] = []
    for t in sorted(graph.tasks, key=lambda t: t.seq):
        if t.kind == G_OUT and isinstance(t.data, Gradients) and t.pack not in order:
            order.append(t.pack)
    return order


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
