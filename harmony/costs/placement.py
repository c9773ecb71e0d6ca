"""Which training state lives in host memory and which on disk: :func:`place_state`.

Pure arithmetic, shared by the task-graph builder (which adds the disk
transfers a placement implies) and the engine's disk tier (which stores them).

Rule: optimizer state goes to disk first (only the update touches it, once
per step), then master weights, then gradients, pack by pack, until what
stays fits the host budget. Packs go out last pack first: in the backward
pass the last pack's update runs first, so its disk traffic overlaps the
backward of the packs before it, while the first pack's update ends the
step and nothing hides its disk traffic.

A (pack, kind) on disk still passes through host memory while it is used:
the tier's staging buffers hold three packs' worth of what is on disk (the
pack being updated, the next one, read ahead, and the previous one, being
written back: so the update overlaps both), and they count in the budget.
The packs staged at once are neighbours among those with state on disk (the
updates run one pack after the other), so staging is the most that three
such neighbours hold (:func:`staged_at_once`), not three times the largest:
a 50k-word embedding on disk is staged beside two blocks, not two more
embeddings.

Stashes (and offloaded activations) go to disk last, only where even the
state on disk leaves too little host memory for all of them: they are
written as they reach host memory and read back ahead of their copy to a GPU,
through :data:`STASH_SLOTS` pieces per GPU each way.

Gradients never go to disk: the host sums them as they arrive. A plan whose
packs' gradients arrive pack after pack can hold them in
:data:`GRADIENT_SLOTS` pack-sized slots instead of one buffer for the whole
model (``Placement.gradient_slots``; see :mod:`harmony.policies.disk_tier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import HarmonyError
from .hardware import format_bytes, parse_bytes

#: the order state goes to disk
KINDS = ("optimizer", "weights", "gradients")
#: packs whose on-disk state is in host memory at once: one updated, one read ahead and
#: one written back (with two, a read would wait for the previous write to end)
STAGED_PACKS = 3
#: per GPU, pieces of stashes (and offloaded activations) in host memory on each side of
#: the disk when they are on disk: two written behind the forward pass (a stash waits for
#: the write of the one two before it on its GPU's share) and two read ahead of backward
STASH_SLOTS = 2
#: packs whose gradients are in host memory at once when they are held in slots: one
#: being updated while the next one's arrive (a pack's gradients then wait for the
#: update of the pack two before it)
GRADIENT_SLOTS = 2


class HostMemoryError(HarmonyError):
    """Training state and what a run keeps in host memory do not fit the host
    budget (with what a disk tier can take, where there is one). ``available``:
    the host memory the refused placement was given, bytes, where known."""

    def __init__(self, message: str, available: float | None = None):
        super().__init__(message)
        self.available = available


@dataclass(frozen=True)
class PackBytes:
    """The host state of one pack, bytes: master weights, gradients, optimizer state."""

    weights: int
    gradients: int
    optimizer: int

    def of(self, kind: str) -> int:
        return getattr(self, kind)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class Placement:
    """Where each pack's state lives, what it costs the host, and the disk
    traffic of one training step (closed form)."""

    on_disk: tuple[tuple[int, str], ...]  # (pack, kind), in the order they went out
    budget: int  # host bytes available to the training state
    reserve: int  # of which kept for the engine's own buffers
    host_state_bytes: int  # state that stays in host memory
    staging_bytes: int  # the disk tier's staging buffers
    disk_bytes: int  # state on disk (the tier keeps two slots of each: twice this on disk)
    read_bytes_per_step: int
    write_bytes_per_step: int
    #: packs whose gradients the reserve holds at once (0: every pack's, the whole step)
    gradient_slots: int = 0
    #: a pack's backward weight loads take its master weights from its update's read
    #: (the update runs right after the pack's backward, on one GPU), so weights on disk
    #: are read twice per step, not three times (see :mod:`harmony.policies.disk_tier`)
    weights_with_update: bool = False
    #: the minibatch's stashed pack inputs and offloaded activations are on disk too:
    #: each written as it reaches host memory and read back before its copy to the GPU
    #: (their bytes are in the reads and writes per step); the reserve then holds
    #: :data:`STASH_SLOTS` pieces per GPU on each side, not all of them
    stashes_on_disk: bool = False
    #: bytes of stashes and offloaded activations on disk per step (scratch: one copy)
    stash_disk_bytes: int = 0

    @property
    def uses_disk(self) -> bool:
        """Whether anything lives on disk: training state, or stashes."""
        return bool(self.on_disk) or self.stashes_on_disk

    @property
    def host_bytes(self) -> int:
        """Host memory used: state kept there, staging buffers and the reserve."""
        return self.host_state_bytes + self.staging_bytes + self.reserve

    @property
    def disk_bytes_per_step(self) -> int:
        return self.read_bytes_per_step + self.write_bytes_per_step

    def where(self, pack: int, kind: str) -> str:
        """``"disk"`` or ``"host"``."""
        return "disk" if (pack, kind) in self.on_disk else "host"

    def kinds_on_disk(self, pack: int) -> tuple[str, ...]:
        """The kinds of ``pack``'s state on disk, in :data:`KINDS` order."""
        return tuple(k for k in KINDS if (pack, k) in self.on_disk)

    def disk_seconds(self, read_rate: float, write_rate: float) -> float:
        """Seconds per step the disk is busy at these bandwidths (bytes/s): a lower
        bound of the step when nothing overlaps it."""
        return self.read_bytes_per_step / read_rate + self.write_bytes_per_step / write_rate


def place_state(
    packs: Sequence[PackBytes],
    budget: str | int,
    *,
    reserve: str | int,
    weight_reads: int = 1,
) -> Placement:
    """The placement of ``packs`` (in layer order) that fits ``budget`` (bytes, or
    a size such as ``"24GiB"``) less ``reserve`` (what the run keeps in host
    memory beside this state: stashes, buffer pools and the like), moving as
    little as the rule in the module docstring allows. :class:`HostMemoryError`
    when even all of it on disk does not fit.

    Disk bytes per step, closed form: every (pack, kind) on disk is read once
    and written once, as its update reads it and writes it back (gradients:
    written when they reach the host, read by the update). ``weight_reads``:
    reads of on-disk master weights per step (1: the update's; a plan that also
    fetches them from disk for its forward and backward passes reads 3)."""
    limit = parse_bytes(budget, "host memory budget")
    reserve = parse_bytes(reserve, "host memory reserve")
    for i, pack in enumerate(packs):
        if min(pack.weights, pack.gradients, pack.optimizer) < 0:
            raise HostMemoryError(f"pack {i}: state sizes must be >= 0, got {pack}")
    moves = [(i, kind) for kind in KINDS for i in reversed(range(len(packs))) if packs[i].of(kind)]
    total = sum(p.total for p in packs)
    # staging holds neighbouring packs, so a move never adds more staging than it frees
    # (the packs staged beside the one it adds were within a window before): where the
    # rule runs out of moves, nothing fits
    on_disk, disk_of = _moved(packs, moves, limit - reserve, total)
    if _host_use(total, disk_of) + reserve > limit:
        raise HostMemoryError(
            f"host memory: even with all the state on disk the host needs "
            f"{format_bytes(_host_use(total, disk_of) + reserve)} (staging for "
            f"{STAGED_PACKS} packs {format_bytes(staged_at_once(disk_of))}, "
            f"reserve {format_bytes(reserve)}) but the budget is {format_bytes(limit)}: use "
            "smaller packs, a smaller reserve (fewer stashes in flight) or a larger budget"
        )
    reads = sum(packs[i].of(k) * (weight_reads if k == "weights" else 1) for i, k in on_disk)
    return Placement(
        on_disk=tuple(on_disk),
        budget=limit,
        reserve=reserve,
        host_state_bytes=total - sum(disk_of),
        staging_bytes=staged_at_once(disk_of),
        disk_bytes=sum(disk_of),
        read_bytes_per_step=reads,
        write_bytes_per_step=sum(disk_of),
    )


def most_in_window(sizes: Sequence[int], n: int) -> int:
    """The most any ``n`` neighbours of ``sizes`` add up to (fewer at the ends)."""
    return max((sum(sizes[i : i + n]) for i in range(len(sizes))), default=0)


def staged_at_once(disk_of: Sequence[int]) -> int:
    """Host bytes the tier stages at most with ``disk_of`` bytes of each pack on disk
    (in layer order, or in the order the updates run): the most any
    :data:`STAGED_PACKS` neighbours among the packs with state on disk hold. The
    read for an update waits for the write-back of the update that many before
    it with state on disk, so no others are staged beside it."""
    return most_in_window([n for n in disk_of if n], STAGED_PACKS)


def _host_use(total: int, disk_of: list[int]) -> int:
    """Host bytes of the state with ``disk_of`` bytes of each pack on disk, staging included."""
    return total - sum(disk_of) + staged_at_once(disk_of)


def _moved(
    packs: Sequence[PackBytes], moves: list[tuple[int, str]], room: int, total: int
) -> tuple[list[tuple[int, str]], list[int]]:
    """The (pack, kind) ``moves`` made in order until the state fits ``room`` host
    bytes (or none is left), and the bytes on disk per pack."""
    on_disk: list[tuple[int, str]] = []
    disk_of = [0] * len(packs)
    for i, kind in moves:
        if _host_use(total, disk_of) <= room:
            break
        on_disk.append((i, kind))
        disk_of[i] += packs[i].of(kind)
    return on_disk, disk_of
