"""The disk tier in the task graph: which training state of a plan lives on
disk (:func:`place`) and the transfers that move it (:func:`add_disk_tasks`),
with their bytes in closed form (:func:`disk_volume`).

**Placement.** The host budget is ``Hardware.host_memory``. Beside the
training state (per backward pack: master weights, gradients, optimizer
state; :func:`~.state.host_state`) the run keeps in host memory a *reserve*:

* every stashed pack input and offloaded activation of the minibatch (the
  plan's STASH_OUT + ACT_OUT bytes: at the end of forward they are all there
  at once, as the engine's host check counts them);
* the gradients: the host sums them as they arrive, microbatch by
  microbatch (or shard by shard), so a copy on disk would save nothing
  while they are summed; they never go to disk. All of them, for the whole
  step, where that fits; else, where the policy's gradients arrive pack after
  pack (its ``GRADIENT_WINDOW``), :data:`~harmony.costs.placement.GRADIENT_SLOTS`
  slots of the largest pack's: the G_OUTs of a pack wait for the update of
  the pack that many before it (:func:`hold_gradients_in_slots`), and a
  parameter tied across packs keeps its gradient for the step (its parts come
  from several packs' backward);
* with ``gpu_optimizer``, the whole state of a plan that swaps it to the
  GPU for the update (OPT_IN / OPT_OUT): the baselines that do so (virtual
  memory, GPipe with swapping) have no disk tier; a plan whose state stays
  on its GPUs (``model-parallel``) keeps none on the host.

What does not fit goes to disk by :func:`harmony.costs.placement.place_state`'s
rule: optimizer state, then master weights, last pack first. Where even all of
that on disk leaves too little for the stashes and offloaded activations,
they go to disk too (``Placement.stashes_on_disk``), and the reserve holds
only :func:`stashes_in_flight` of them: :data:`~harmony.costs.placement.STASH_SLOTS`
pieces per GPU on their way to disk and as many on their way back, each at
most :func:`stash_piece_bytes`; the state then comes back to host memory as
far as it fits. A server without a disk tier (``Hardware.disk_read`` None)
must fit it all: :class:`~harmony.costs.placement.HostMemoryError` otherwise,
saying what to set.

**Tasks** (only where something is on disk, so a plan that fits host memory
gets the graph it always had), on lanes and links ``host.disk_read`` and
``host.disk_write``, device ``host``:

* around each CPU update (UPD) of a pack with state on disk: a DISK_IN
  before it reads that state (payload :class:`~harmony.graph.DiskState`: the
  pack, its kinds on disk and the update's shard), a DISK_OUT after it writes
  it back, updated. The staging buffers hold three packs (``STAGED_PACKS``),
  so the read for the j-th such update (in priority order: last pack first)
  waits for the write of the (j-3)-th: while a pack updates, the next pack's
  state is read and the previous one's written;
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
from dataclasses import asdict, replace
from typing import Iterable, Mapping

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import (
    GRADIENT_SLOTS,
    STAGED_PACKS,
    STASH_SLOTS,
    HostMemoryError,
    PackBytes,
    Placement,
    place_state,
)
from ..costs.spec import ModelSpec, Tie, dtype_bytes
from ..graph import (
    ACT_IN,
    ACT_OUT,
    DISK_IN,
    DISK_OUT,
    G_OUT,
    OPT_IN,
    STASH_IN,
    STASH_OUT,
    UPD,
    W_IN,
    Activation,
    DiskState,
    Gradients,
    Task,
)
from ..plan import Pack, Plan, layer_shard
from .base import HOST, GraphBase
from .state import host_state

READ = "host.disk_read"
WRITE = "host.disk_write"
#: the disk's time, where reads and writes share it (``Hardware.disk_shared``)
SHARED = "host.disk"


def place(
    spec: ModelSpec,
    plan: Plan,
    hw: Hardware,
    moved: Mapping[str, float],
    window: bool = False,
    ride: bool = False,
) -> Placement:
    """Where ``plan``'s state lives on ``hw`` (the module docstring's rule);
    ``moved``: its bytes per transfer kind (the closed form, or a graph's);
    ``window``: the plan's packs' gradients arrive pack after pack, so they
    can be held in slots (the policy's ``GRADIENT_WINDOW``); ``ride``: each
    pack's backward weight loads take master weights on disk from its
    update's read (the policy's ``WEIGHTS_WITH_UPDATE``; on one GPU)."""
    state = [host_state(spec, range(*p)) for p in plan.bwd_packs]
    stash = int(moved.get(STASH_OUT, 0.0) + moved.get(ACT_OUT, 0.0))
    if plan.option("gpu_optimizer"):
        pinned = sum(p.total for p in state) if moved.get(OPT_IN, 0.0) else 0
        movable = [PackBytes(0, 0, 0)] * len(state)
        choices = [(0, pinned)]
    else:
        movable = [replace(p, gradients=0) for p in state]
        choices = [(0, sum(p.gradients for p in state))]
        slots = windowed_gradients(spec, plan)
        if window and not plan.option("gpu_gradients") and slots < choices[0][1]:
            choices.append((GRADIENT_SLOTS, slots))
    # the whole model's gradients if all then fits host memory; else gradient slots
    # where the plan allows them (they put less on disk), and the disk for the rest
    # on one GPU only: where several GPUs run backward packs at once, reads moved
    # ahead of their loads wait on the three staged packs and hold the pipeline up
    ride = ride and plan.n_gpus == 1
    placed = _fits(movable, hw, choices, stash, ride)
    if placed and (hw.has_disk or not placed[-1].on_disk):
        return placed[-1]
    # then the stashes too, where even that leaves too little for them all
    in_flight = stashes_in_flight(spec, plan)
    if hw.has_disk and in_flight < stash:
        placed = _fits(movable, hw, choices, in_flight, ride)
        if placed:
            reads = int(moved.get(STASH_OUT, 0.0) + moved.get(ACT_IN, 0.0))
            return replace(
                placed[-1],
                stashes_on_disk=True,
                stash_disk_bytes=stash,
                read_bytes_per_step=placed[-1].read_bytes_per_step + reads,
                write_bytes_per_step=placed[-1].write_bytes_per_step + stash,
            )
        stash = in_flight  # for the error: the least they take in host memory
    slots, gradients = choices[-1]
    held = (
        f"gradient slots for {slots} packs {format_bytes(gradients)}"
        if slots
        else f"gradients {format_bytes(gradients)}"
    )
    if hw.has_disk and any(p.total for p in movable):
        least = stash + gradients + STAGED_PACKS * max(p.total for p in movable)
        raise HostMemoryError(
            f"host memory: {plan.policy} on {hw.name!r} needs at least "
            f"{format_bytes(least)} of host memory even with its optimizer state, "
            f"master weights and stashes on disk ({held}, stashes and offloaded activations "
            f"{format_bytes(stash)}, staging for {STAGED_PACKS} packs) but host_memory is "
            f"{format_bytes(hw.host_memory)}: give more host memory (--host-memory, "
            "Hardware.with_host_memory), or smaller backward packs (less to stage) or fewer "
            "stashes",
            available=hw.host_memory,
        )
    total = sum(p.total for p in movable) + gradients + stash
    if plan.option("gpu_optimizer"):
        fix = "run without gpu_optimizer (the CPU update can read its state from a disk tier) or "
    else:
        fix = "give the server a disk tier (--disk nvme, Hardware.with_disk) or "
    raise HostMemoryError(
        f"host memory: {plan.policy} on {hw.name!r} keeps {format_bytes(total)} in host "
        f"memory (training state {format_bytes(total - stash)}, of which {held}, stashes and "
        f"offloaded activations {format_bytes(stash)}) but host_memory is "
        f"{format_bytes(hw.host_memory)}: {fix}more host memory (--host-memory)",
        available=hw.host_memory,
    )


def _fits(
    movable: list[PackBytes],
    hw: Hardware,
    choices: list[tuple[int, int]],
    stash: int,
    ride: bool,
) -> list[Placement]:
    """The placements of ``movable`` that fit ``hw``'s host memory beside ``stash``
    bytes of stashes and each choice of (gradient slots, gradient bytes), up to the
    first that puts nothing on disk; ``ride``: as for :func:`place`, on one GPU."""
    placed = []
    for slots, gradients in choices:
        try:
            placement = place_state(movable, hw.host_memory, reserve=stash + gradients)
        except HostMemoryError:
            continue
        with_update = ride and any(k == "weights" for _, k in placement.on_disk)
        placed.append(replace(placement, gradient_slots=slots, weights_with_update=with_update))
        if not placement.on_disk:
            break
    return placed


def stash_piece_bytes(spec: ModelSpec, plan: Plan) -> int:
    """The most bytes one stash (or offloaded activation) transfer of ``plan``
    moves: one layer's input (or its gradient) for a microbatch."""
    u = max(plan.fwd_microbatch, plan.bwd_microbatch)
    sizes = [spec.input_bytes(layer, u) for layer in plan.stash_layers() if layer > 0]
    if plan.option("offload_activations"):
        bounds = {b for _, b in plan.fwd_packs} | {a for a, _ in plan.bwd_packs}
        sizes += [
            max(spec.input_bytes(layer, u), spec.input_grad_bytes(layer, u))
            for layer in bounds
            if 0 < layer < len(spec)
        ]
    return int(max(sizes, default=0))


def stashes_in_flight(spec: ModelSpec, plan: Plan) -> int:
    """Host bytes of stashes (and offloaded activations) held at once when they
    are on disk: :data:`STASH_SLOTS` pieces per GPU written behind its forward
    and as many read ahead of its backward."""
    return 2 * STASH_SLOTS * plan.n_gpus * stash_piece_bytes(spec, plan)


def tied_across_packs(spec: ModelSpec, plan: Plan) -> list[Tie]:
    """The ties whose layers are in more than one backward pack: their gradient
    sums parts from several packs' backward, so it is held the whole backward."""
    packs = plan.bwd_packs
    return [
        tie
        for tie in spec.ties
        if len({q for q, (a, b) in enumerate(packs) for i in tie.layers if a <= i < b}) > 1
    ]


def windowed_gradients(spec: ModelSpec, plan: Plan) -> int:
    """Host bytes of gradients held in :data:`GRADIENT_SLOTS` slots: that many of
    the largest pack's (less the ties across packs), and the ties' for the step."""
    master = dtype_bytes(spec.master_dtype or spec.param_dtype)
    tied = {tie.layers[0]: tie.numel * master for tie in tied_across_packs(spec, plan)}
    per_pack = [
        host_state(spec, range(a, b)).gradients - sum(n for i, n in tied.items() if a <= i < b)
        for a, b in plan.bwd_packs
    ]
    return GRADIENT_SLOTS * max(per_pack, default=0) + sum(tied.values())


def weight_packs(spec: ModelSpec, plan: Plan, layers: Pack) -> list[int]:
    """The backward packs whose weights a load of ``layers`` reads: those it
    overlaps, and the pack stepping each tied parameter it holds."""
    s, e = layers
    owners = {tie.layers[0] for tie in spec.ties if tie.in_range(s, e)}
    return [
        q
        for q, (a, b) in enumerate(plan.bwd_packs)
        if (a < e and s < b) or any(a <= i < b for i in owners)
    ]


def disk_volume(
    spec: ModelSpec,
    plan: Plan,
    placement: Placement,
    loads: Iterable[tuple[Pack, float]],
    backward: Iterable[tuple[int, float]] = (),
) -> dict[str, float]:
    """DISK_IN and DISK_OUT bytes of one iteration, closed form: every (pack, kind)
    on disk read by its update and written back, and the weights on disk read
    again by every load of a pack that needs them (``loads``: the layers of each
    pack the plan loads, and how many times per iteration; ``backward``: the
    backward packs the plan loads for their backward, and how many times: with
    ``placement.weights_with_update``, those loads take their own pack's
    weights from its update's read)."""
    weights = _disk_weights(spec, plan, placement)
    reads = sum(n * sum(weights[q] for q in weight_packs(spec, plan, p)) for p, n in loads)
    ride = placement.weights_with_update
    for q, n in backward:
        packs = weight_packs(spec, plan, plan.bwd_packs[q])
        reads += n * sum(weights[o] for o in packs if not (ride and o == q))
    return {
        DISK_IN: float(placement.read_bytes_per_step + reads),
        DISK_OUT: float(placement.write_bytes_per_step),
    }


def add_disk_tasks(b: GraphBase, window: bool = False, ride: bool = False) -> dict | None:
    """Place the state of ``b``'s plan (``window``, ``ride``: as for :func:`place`)
    and add the disk transfers and gradient slots it implies (see the module
    docstring). Returns the placement for the graph's ``info``, or None when it
    all fits host memory as it always did (the graph is left as it was)."""
    moved: dict[str, float] = defaultdict(float)
    for t in b.tasks:
        if t.is_transfer:
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
    priority order) wait for the updates of the (j - ``slots``)-th: its slot.
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
    for j in range(slots, len(order)):
        free = updates[order[j - slots]]
        for out in outs[order[j]]:
            if any(u.seq >= out.seq for u in free):
                raise AssertionError(
                    f"{b.plan.policy}: the gradients of pack {out.pack} arrive before the update "
                    f"of pack {order[j - slots]} ({slots} packs earlier): its GRADIENT_WINDOW "
                    "is wrong for this plan"
                )
            out.deps = sorted(set(out.deps) | {u.id for u in free})


def _add_transfers(b: GraphBase, placement: Placement) -> None:
    """The DISK_IN and DISK_OUT tasks of the state ``placement`` puts on disk
    (the module docstring's)."""
    weights = _disk_weights(b.spec, b.plan, placement)
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
        slot = written[-STAGED_PACKS] if len(written) >= STAGED_PACKS else None
        served = [b.tasks[i] for i in riders.get(update.pack, ())]
        first = min([update, *served], key=lambda t: t.seq)  # the read comes before it
        if slot is not None and slot.seq >= first.seq:
            raise AssertionError(
                f"{b.plan.policy}: the read for the update of pack {update.pack} must wait for "
                f"the write of pack {slot.pack}, which comes after it: its WEIGHTS_WITH_UPDATE "
                "is wrong for this plan"
            )
        label = f"UPD {update.layers}" + (" and its backward weight loads" if served else "")
        read = _disk(b, DISK_IN, first, -1, nbytes, [slot.id] if slot else [], data, label)
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


def _disk_weights(spec: ModelSpec, plan: Plan, placement: Placement) -> list[int]:
    """Per backward pack, the bytes of its master weights on disk (0: in host memory)."""
    return [
        host_state(spec, range(*p)).weights if placement.where(q, "weights") == "disk" else 0
        for q, p in enumerate(plan.bwd_packs)
    ]


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
