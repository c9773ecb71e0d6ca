"""The task-graph IR that every policy builds and both executors play.

A :class:`TaskGraph` is a set of :class:`Task` on *lanes* (``gpu0.compute``,
``gpu0.h2d``, ``gpu0.d2h``, ``gpu0.p2p``, ``cpu0``, ...). A lane runs one task
at a time, and a task starts when its lane is free and every dependency has
ended. GPU compute lanes run their tasks strictly in ``seq`` order (the order
of microbatches fixes the order gradients accumulate in, hence exactness);
transfer and CPU lanes run whichever of their ready tasks has the smallest
``seq`` (the data needed soonest first, so a large prefetch never holds up an
urgent input). Compute tasks have a duration; transfer tasks have bytes and a
route of links whose bandwidth they share with concurrent transfers. State
that does not fit host memory crosses ``host.disk_read`` / ``host.disk_write``
(DISK_IN, DISK_OUT; :mod:`harmony.policies.disk_tier` says when), and also
``host.disk`` where reads and writes share the disk's time (a link whose
capacity a byte takes as much of as the task's ``costs`` say).

Memory is a set of :class:`Buffer`: a task *allocates* buffers when it starts
and *releases* its references when it ends; a buffer is freed when its last
reference is released. Policies give every task a ``seq`` such that every
dependency has a smaller ``seq``: then the unfinished task with the smallest
``seq`` can always run, and playing the graph cannot deadlock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

# Compute kinds. A backward pack's op is two tasks: REC recomputes the pack's forward
# with autograd from its stashed input (it needs the weights and the stash only), BWD
# runs backward once the output gradient is there; the fused last pack is one FWDBWD.
FWD, REC, BWD, FWDBWD, UPD = "FWD", "REC", "BWD", "FWDBWD", "UPD"
# Transfer kinds and what they move
W_IN = "W_IN"  # weights host -> GPU
G_OUT = "G_OUT"  # weight gradients GPU -> host
STASH_OUT = "STASH_OUT"  # a backward pack's input, saved during forward
STASH_IN = "STASH_IN"  # ... brought back for recompute
ACT_OUT = "ACT_OUT"  # activations / their gradients offloaded between packs
ACT_IN = "ACT_IN"
P2P = "P2P"  # activations / their gradients GPU -> GPU
DATA_IN = "DATA_IN"  # minibatch inputs and labels
REDUCE = "REDUCE"  # data-parallel gradient reduce-scatter, per GPU
# Training state that the swapping baselines keep in (virtual) GPU memory
G_IN = "G_IN"  # a gradient accumulator host -> GPU, to add one more microbatch to it
OPT_IN = "OPT_IN"  # weights, gradients and optimizer state host -> GPU, for an update there
OPT_OUT = "OPT_OUT"  # updated weights and optimizer state GPU -> host
# Training state that lives on the disk tier under host memory (harmony.policies.disk_tier)
DISK_IN = "DISK_IN"  # a pack's on-disk state disk -> host, for its update or a weight load
DISK_OUT = "DISK_OUT"  # a pack's updated on-disk state host -> disk

COMPUTE_KINDS = frozenset({FWD, REC, BWD, FWDBWD, UPD})
#: kinds whose lane runs strictly in seq order
IN_ORDER_KINDS = frozenset({FWD, REC, BWD, FWDBWD})
TRANSFER_KINDS = frozenset(
    {
        W_IN,
        G_OUT,
        STASH_OUT,
        STASH_IN,
        ACT_OUT,
        ACT_IN,
        P2P,
        DATA_IN,
        REDUCE,
        G_IN,
        OPT_IN,
        OPT_OUT,
        DISK_IN,
        DISK_OUT,
    }
)
#: transfers between host memory and the disk tier (not swap: they use no GPU link)
DISK_KINDS = (DISK_IN, DISK_OUT)


# ---- what a task moves or steps (its payload) ----------------------------------------------
@dataclass(frozen=True)
class Weights:
    """A pack's weights (and buffers), host -> GPU."""

    layers: tuple[int, int]


@dataclass(frozen=True)
class Batch:
    """The minibatch's ``inputs`` or ``labels`` for some samples, host -> GPU."""

    what: str  # "inputs" | "labels"
    samples: tuple[int, int]


@dataclass(frozen=True)
class Activation:
    """The input of ``layer`` for some samples (``"act"``), the same kept for
    recompute (``"stash"``), or its gradient (``"grad"``)."""

    what: str  # "act" | "stash" | "grad"
    layer: int
    samples: tuple[int, int]


@dataclass(frozen=True)
class Gradients:
    """A pack's gradient, or shard ``(r, k)`` of it (every k-th layer from the
    r-th, summed over the data-parallel replicas), GPU -> host."""

    layers: tuple[int, int]
    shard: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class TiedGradients:
    """One microbatch's gradient of the parameters a pack shares with other packs."""

    layers: tuple[int, int]
    samples: tuple[int, int]


@dataclass(frozen=True)
class Update:
    """The CPU optimizer step of a pack's parameters, or of shard ``(r, k)`` of them."""

    layers: tuple[int, int]
    shard: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class DiskState:
    """Training state kept on the disk tier, between disk and host memory:
    ``kinds`` (``"weights"``: master weights, ``"optimizer"``: optimizer state) of
    each backward pack in ``packs``, or of shard ``(r, k)`` of the one pack
    ``packs[0]`` (the layers :func:`~harmony.plan.layer_shard` gives, as the
    :class:`Update` it serves). Shard ``(0, 1)`` is the whole pack, in
    whatever files hold it. ``load``: read for weight loads (W_IN) only, not
    for an update (whose read a backward weight load of its pack may share)."""

    packs: tuple[int, ...]
    kinds: tuple[str, ...]
    shard: tuple[int, int] = (0, 1)
    load: bool = False


def is_load_read(task: "Task") -> bool:
    """A DISK_IN of master weights for weight loads only (``DiskState.load``); not
    an update's, nor a stash's (payload :class:`Activation`)."""
    return task.kind == DISK_IN and isinstance(task.data, DiskState) and task.data.load


Payload = Weights | Batch | Activation | Gradients | TiedGradients | Update | DiskState | None


@dataclass(slots=True)
class Task:
    id: int
    kind: str
    lane: str
    device: str  # where it runs: "gpu0".., "cpu" (updates), "host" (disk transfers)
    #: priority; (op, 0, n) inputs of op, (op, 1, 0) the op, (op, 2, n) after it; the
    #: builder leaves room between the n of its transfers and updates for disk tasks
    seq: tuple[int, int, int]
    deps: list[int] = field(default_factory=list)
    duration: float = 0.0  # seconds (compute)
    nbytes: float = 0.0  # bytes (transfer)
    links: tuple[str, ...] = ()  # route of a transfer
    max_rate: float = math.inf  # per-transfer cap (e.g. the P2P bandwidth)
    model: int = 0
    pack: int = -1  # index into the plan's bwd packs (REC/BWD/FWDBWD/UPD/G_OUT), fwd packs (FWD)
    layers: tuple[int, int] = (0, 0)
    microbatch: int = -1
    samples: tuple[int, int] = (0, 0)
    what: str = ""  # for people reading traces
    #: what the task moves or steps, for an executor (a transfer's data, an update's layers)
    data: Payload = None
    #: the buffers the task works on, by role, for an executor: "weights", "grads", "input",
    #: "labels", "stash_in", "grad_in" (lists), "output", "stash" ({layer: buffer}), "src", "dst",
    #: "work" (working memory), "saved" (what a REC keeps for its BWD: autograd's saved tensors)
    io: dict = field(default_factory=dict)
    allocs: list[int] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    #: per link of ``links``, how much of its capacity one byte moved takes (empty: 1 on
    #: each); a disk whose reads and writes share its time is a link of capacity 1 that a
    #: byte read takes 1/read-bandwidth of (seconds), a byte written 1/write-bandwidth
    costs: tuple[float, ...] = ()

    def link_costs(self) -> tuple[float, ...]:
        """Per link of the route, the capacity one byte takes."""
        return self.costs or (1.0,) * len(self.links)

    @property
    def is_transfer(self) -> bool:
        return self.kind in TRANSFER_KINDS


@dataclass(slots=True)
class Buffer:
    id: int
    device: str
    nbytes: float
    what: str
    refs: int = 0  # releases still to come before it is freed
    samples: tuple[int, int] = (0, 0)  # the samples an activation buffer holds


@dataclass
class TaskGraph:
    tasks: list[Task]
    buffers: list[Buffer]
    links: dict[str, float]  # link name -> bytes/s (per direction)
    memory_capacity: dict[str, float]  # device -> bytes
    samples: int  # samples processed by one play of the graph (the minibatch)
    cpu_workers: int
    info: dict = field(default_factory=dict)  # plan, spec and hardware names, policy notes

    def lanes(self) -> dict[str, list[int]]:
        """Task ids per lane in the order the lane runs them."""
        out: dict[str, list[Task]] = defaultdict(list)
        for t in self.tasks:
            out[t.lane].append(t)
        return {lane: [t.id for t in sorted(ts, key=lambda t: t.seq)] for lane, ts in out.items()}

    def in_order_lanes(self) -> set[str]:
        """Lanes that run strictly in seq order (GPU compute)."""
        return {t.lane for t in self.tasks if t.kind in IN_ORDER_KINDS}

    def bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self.tasks:
            if t.is_transfer:
                out[t.kind] += t.nbytes
        return dict(out)

    def check(self) -> None:
        """Invariants every policy must keep (used by tests)."""
        ids = {t.id for t in self.tasks}
        assert ids == set(range(len(self.tasks))), "task ids must be 0..n-1"
        for t in self.tasks:
            for d in t.deps:
                assert self.tasks[d].seq < t.seq, f"dependency {self.tasks[d]} not before {t}"
            for link in t.links:
                assert link in self.links, f"{t} uses unknown link {link}"
            assert not t.costs or len(t.costs) == len(t.links), f"{t}: one cost per link"
        refs = defaultdict(int)
        for t in self.tasks:
            for b in t.releases:
                refs[b] += 1
        for b in self.buffers:
            assert refs[b.id] == b.refs, f"buffer {b} has {refs[b.id]} releases, expected {b.refs}"
