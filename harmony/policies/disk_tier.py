"""The disk tier in the task graph: the transfers (:func:`add_disk_tasks`) that
move the training state :func:`.tier_placement.place` puts on disk, whose bytes
:func:`.tier_placement.disk_volume` gives in closed form.

**Tasks** (only where something is on disk, so a plan that fits host memory
gets the graph it always had), on lanes and links ``host.disk_read`` and
``host.disk_write``, device ``host``:

* around each CPU update (UPD) of a pack with state on disk: a DISK_IN
  before it reads that state (payload :class:`~harmony.graph.DiskState`: the
  pack, its kinds on disk and the update's shard), a DISK_OUT after it writes
  it back, updated. The staging buffers hold three neighbouring packs
  (``STAGED_PACKS``), so the read for the j-th such update (in priority
  order: last pack first) waits for the writes of the (j-3)-th, and of the
  two before it (updates do not wait on each other, so one may end after
  the next: see :func:`window_before`): while a pack updates, the next
  pack's state is read and the previous one's written;
* before each weight load (W_IN) whose layers hold weights on disk: a
  DISK_IN of the whole weights of every backward pack it touches whose
  weights are on disk (files hold whole packs; a parameter tied into the
  load counts its owner's pack), once the load's own dependencies are met;
* but on one GPU a pack's backward weight loads take its weights from its
  update's DISK_IN where the policy says each pack's one update follows its
  backward (``WEIGHTS_WITH_UPDATE``: Harmony's pipeline, HYDRA): that read
  comes before the pack's first backward load, which depends on it, and its
  staged weights serve the loads and then the update, so the weights on disk
  are read twice a step (forward load, update) rather than three times. Not
  on several GPUs: there several packs are in backward at once, and reads
  moved ahead of their loads, each waiting for the write three updates back,
  hold the pipeline up (GPT-2 XL, harmony-pp on 4 GPUs over a 1 GB/s disk:
  26% slower for 20% fewer bytes read).

* with the stashes on disk: a DISK_OUT after each STASH_OUT and ACT_OUT
  writes the piece it brought (payload :class:`~harmony.graph.Activation`),
  and the j-th such transfer (in priority order) waits for the write of the
  (j - STASH_SLOTS x GPUs)-th; a DISK_IN before each STASH_IN and ACT_IN of a
  value written there reads the samples it needs once the writes of the
  pieces it covers are done and the transfer back that many before it has
  copied its own (layer 0's stash is the minibatch, in host memory: no read).
  Each stash is written once and read once a step, so the closed form adds
  the plan's STASH_OUT + ACT_OUT bytes to the writes and STASH_OUT + ACT_IN
  bytes to the reads.

Where the disk's reads and writes share its time (``Hardware.disk_shared``:
a read and a write at once take the sum of their times alone), every disk
transfer also crosses the link ``host.disk``, of capacity 1: a byte read
takes ``1/disk_read`` of it, a byte written ``1/disk_write``, so a DISK_IN
and a DISK_OUT at once split the disk's time, and the disk's lower bound is
the sum of read and write times rather than the longer of the two.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict

from ..costs.hardware import format_bytes
from ..costs.placement import STAGED_PACKS, STASH_SLOTS, Placement, most_in_window
from ..graph import (
    ACT_IN,
    ACT_OUT,
    DISK_IN,
    DISK_OUT,
    G_OUT,
    STASH_IN,
    STASH_OUT,
    TRANSFER_KINDS,
    UPD,
    W_IN,
    Activation,
    DiskState,
    Gradients,
    Task,
)
from ..plan import layer_shard
from .base import HOST, GraphBase
from .state import host_state
from .tier_placement import (  # noqa: F401  (placement's names, read here too)
    disk_volume,
    disk_weights,
    gradients_per_pack,
    place,
    stash_piece_bytes,
    stashes_in_flight,
    tied_across_packs,
    weight_packs,
    windowed_gradients,
)

READ = "host.disk_read"
WRITE = "host.disk_write"
#: the disk's time, where reads and writes share it (``Hardware.disk_shared``)
SHARED = "host.disk"


def add_disk_tasks(b: GraphBase, window: bool = False, ride: bool = False) -> dict | None:
    """Place the state of ``b``'s plan (``window``, ``ride``: as for :func:`place`)
    and add the disk transfers and gradient slots it implies (see the module
    docstring). Returns the placement for the graph's ``info``, or None when it
    all fits host memory as it always did (the graph is left as it was)."""
    moved: dict[str, float] = defaultdict(float)
    for t in b.tasks:
        if t.kind in TRANSFER_KINDS:
            moved[t.kind] += t.nbytes
    placement = place(b.spec, b.plan, b.hw, moved, window, ride)
    if not placement.uses_disk and not placement.gradient_slots:
        return None
    if placement.gradient_slots:
        hold_gradients_in_slots(b, placement.gradient_slots)
    if placement.uses_disk:
        _add_links(b)
        _add_transfers(b, placement)
    if placement.stashes_on_disk:
        _add_stash_transfers(b, STASH_SLOTS * b.plan.n_gpus)
    return asdict(placement)


def hold_gradients_in_slots(b: GraphBase, slots: int) -> None:
    """The gradients of the j-th pack whose gradients reach host memory (in
    priority order) wait for the updates of the packs :func:`window_before` it:
    so only it and the ``slots`` - 1 packs before it hold gradients then.
    A policy declares its gradients arrive pack after pack (``GRADIENT_WINDOW``);
    priorities that say otherwise (a pack's update after the first gradient that
    waits for it) would deadlock, and are refused here."""
    outs: dict[int, list[Task]] = defaultdict(list)
    order: list[int] = []
    gradients = [t for t in b.tasks if t.kind == G_OUT and isinstance(t.data, Gradients)]
    for out in sorted(gradients, key=lambda t: t.seq):
        if out.pack not in outs:
            order.append(out.pack)
        outs[out.pack].append(out)
    updates: dict[int, list[Task]] = defaultdict(list)
    for t in b.tasks:
        if t.kind == UPD and t.device == "cpu":
            updates[t.pack].append(t)
    sizes = gradients_per_pack(b.spec, b.plan)
    if most_in_window([sizes[q] for q in order], slots) > most_in_window(sizes, slots):
        raise AssertionError(
            f"{b.plan.policy}: its packs' gradients arrive in the order {order}, where "
            f"{slots} neighbours hold more than any {slots} neighbouring packs: its "
            "GRADIENT_WINDOW is wrong for this plan"
        )
    for j in range(slots, len(order)):
        free = [u for q in window_before(order, j, slots) for u in updates[q]]
        for out in outs[order[j]]:
            for u in free:
                if u.seq >= out.seq:
                    raise AssertionError(
                        f"{b.plan.policy}: the gradients of pack {out.pack} arrive before the "
                        f"update of pack {u.pack}, {slots} or more packs earlier: its "
                        "GRADIENT_WINDOW is wrong for this plan"
                    )
            out.deps = sorted(set(out.deps) | {u.id for u in free})


def window_before(items: list, j: int, n: int) -> list:
    """What the j-th of ``items`` waits for so that at most ``n`` neighbours (it and
    the ``n`` - 1 before it) are held at once: the ``n``-th before it, whose place
    it takes, and the ``n`` - 1 before that. Those each waited likewise, so all
    before them are done too, whatever order the ones that do not wait on each
    other (updates, the disk's reads) end in."""
    return items[max(0, j - 2 * n + 1) : max(0, j - n + 1)]


def _add_transfers(b: GraphBase, placement: Placement) -> None:
    """The DISK_IN and DISK_OUT tasks of the state ``placement`` puts on disk
    (the module docstring's)."""
    weights = disk_weights(b.spec, b.plan, placement)
    loads = [t for t in b.tasks if t.kind == W_IN]
    cpu_updates = sorted(
        (t for t in b.tasks if t.kind == UPD and t.device == "cpu"), key=lambda t: t.seq
    )
    riders = _riders(b, placement, loads, cpu_updates, weights)
    for load in loads:
        packs = [
            q
            for q in weight_packs(b.spec, b.plan, load.layers)
            if weights[q] and load.id not in riders.get(q, ())
        ]
        if packs:
            data = DiskState(tuple(packs), ("weights",), load=True)
            read = _disk(b, DISK_IN, load, -1, sum(weights[q] for q in packs), load.deps, data)
            load.deps = sorted(set(load.deps) | {read.id})
    written: list[Task] = []  # the DISK_OUTs so far: each frees a staging slot
    for update in cpu_updates:
        kinds = placement.kinds_on_disk(update.pack)
        shard = update.data.shard
        state = host_state(b.spec, layer_shard(b.plan.bwd_packs[update.pack], *shard))
        nbytes = sum(state.of(k) for k in kinds)
        if not nbytes:
            continue
        data = DiskState((update.pack,), kinds, shard)
        slots = window_before(written, len(written), STAGED_PACKS)
        served = [b.tasks[i] for i in riders.get(update.pack, ())]
        first = min([update, *served], key=lambda t: t.seq)  # the read comes before it
        for slot in slots:
            if slot.seq >= first.seq:
                raise AssertionError(
                    f"{b.plan.policy}: the read for the update of pack {update.pack} must wait "
                    f"for the write of pack {slot.pack}, which comes after it: its "
                    "WEIGHTS_WITH_UPDATE is wrong for this plan"
                )
        staged = sum(t.nbytes for t in written[-STAGED_PACKS + 1 :]) + nbytes
        if staged > placement.staging_bytes:
            raise AssertionError(
                f"{b.plan.policy}: the read for the update of pack {update.pack} stages "
                f"{format_bytes(staged)} beside the {STAGED_PACKS - 1} before it, more than the "
                f"placement's {format_bytes(placement.staging_bytes)}: its updates do not run "
                "pack after pack"
            )
        label = f"UPD {update.layers}" + (" and its backward weight loads" if served else "")
        read = _disk(b, DISK_IN, first, -1, nbytes, [t.id for t in slots], data, label)
        for t in [update, *served]:
            t.deps = sorted(set(t.deps) | {read.id})
        written.append(_disk(b, DISK_OUT, update, +1, nbytes, [update.id], data))


def _add_links(b: GraphBase) -> None:
    b.links[READ], b.links[WRITE] = b.hw.disk_read, b.hw.disk_write
    if b.hw.disk_shared:
        b.links[SHARED] = 1.0  # seconds of the disk's time per second


def _add_stash_transfers(b: GraphBase, slots: int) -> None:
    """Stashes and offloaded activations through the disk (``stashes_on_disk``):
    a DISK_OUT after each transfer to host memory (STASH_OUT, ACT_OUT) writes
    what it brought, and the transfer ``slots`` before it in priority order
    must have been written first; a DISK_IN before each transfer back (STASH_IN,
    ACT_IN) of such a value reads its samples once the writes of the pieces it
    covers are done and the transfer back ``slots`` before it has copied its own."""
    piece = stash_piece_bytes(b.spec, b.plan)
    outs = sorted((t for t in b.tasks if t.kind in (STASH_OUT, ACT_OUT)), key=lambda t: t.seq)
    writes: dict[tuple[str, int], list[Task]] = defaultdict(list)
    written: list[Task] = []
    for out in outs:
        if out.nbytes > piece:
            raise AssertionError(
                f"{b.plan.policy}: {out.what} moves {format_bytes(out.nbytes)}, more than "
                f"the {format_bytes(piece)} stash_piece_bytes reserves host memory for"
            )
        if len(written) >= slots:
            out.deps = sorted(set(out.deps) | {written[-slots].id})
        data = out.data
        written.append(_disk(b, DISK_OUT, out, +1, out.nbytes, [out.id], data))
        writes[(data.what, data.layer)].append(written[-1])
    ins = sorted(
        (
            t
            for t in b.tasks
            if t.kind in (STASH_IN, ACT_IN) and (t.data.what, t.data.layer) in writes
        ),
        key=lambda t: t.seq,
    )
    for j, back in enumerate(ins):
        (a, e), data = back.data.samples, back.data
        pieces = [
            w.id
            for w in writes[(data.what, data.layer)]
            if w.data.samples[0] < e and a < w.data.samples[1]
        ]
        ahead = [ins[j - slots].id] if j >= slots else []
        read = _disk(b, DISK_IN, back, -1, back.nbytes, pieces + ahead, data)
        back.deps = sorted(set(back.deps) | {read.id})


def _riders(
    b: GraphBase, placement: Placement, loads: list[Task], updates: list[Task], weights: list[int]
) -> dict[int, set[int]]:
    """Per backward pack whose master weights are on disk, the backward weight
    loads that take them from its update's read (``placement.weights_with_update``):
    those of that pack's layers only (``loads``: the graph's W_INs, ``updates``:
    its CPU updates). The policy declares its updates one per pack, each after
    the pack's backward; a sharded update is refused here."""
    if not placement.weights_with_update:
        return {}
    if any(u.data.shard != (0, 1) for u in updates):
        raise AssertionError(
            f"{b.plan.policy}: its updates are sharded, so a backward weight load cannot "
            "take a pack's weights from one update's read: its WEIGHTS_WITH_UPDATE is wrong"
        )
    updated = {u.pack for u in updates}
    riders: dict[int, set[int]] = defaultdict(set)
    for load in loads:
        q = load.pack
        if "grads" not in load.io or q not in updated or not weights[q]:
            continue
        start, end = b.plan.bwd_packs[q]
        if start <= load.layers[0] and load.layers[1] <= end:
            riders[q].add(load.id)
    return riders


def _disk(
    b: GraphBase,
    kind: str,
    of: Task,
    side: int,
    nbytes: int,
    deps: list[int],
    data: DiskState | Activation,
    label: str = "",
) -> Task:
    """A disk transfer for task ``of``, just before (``side`` -1) or after (+1) it in
    priority: the room :data:`~.base.SEQ_ROOM` left there; ``label``: what it is
    for, in words (default: ``of``)."""
    link = READ if kind == DISK_IN else WRITE
    verb = "read" if kind == DISK_IN else "write"
    route, costs = (link,), ()
    if b.hw.disk_shared:  # a byte takes 1/bandwidth seconds of the disk's time
        route, costs = (link, SHARED), (1.0, 1.0 / b.links[link])
    return b.transfer(
        kind,
        link,
        HOST,
        route,
        nbytes,
        deps,
        (
            f"{verb} {'+'.join(data.kinds)} of packs {list(data.packs)} for "
            + (label or f"{of.kind} {of.layers}")
            if isinstance(data, DiskState)
            else f"{verb} {data.what} layer {data.layer} {data.samples}"
        ),
        seq=(of.seq[0], of.seq[1], of.seq[2] + side),
        data=data,
        pack=of.pack,
        layers=of.layers,
        costs=costs,
    )
