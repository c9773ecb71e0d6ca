"""Where a plan's training state lives when host memory is short: which of it
goes to the disk tier (:func:`place`), with the disk's bytes per iteration in
closed form (:func:`disk_volume`); :mod:`.disk_tier` adds the transfers.

The host budget is ``Hardware.host_memory``. Beside the
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
  packs' at once: the G_OUTs of a pack wait for the update of the pack that
  many before it (:func:`hold_gradients_in_slots`), so the most that many
  neighbouring packs' gradients take (:func:`windowed_gradients`), and a
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
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from ..costs.hardware import Hardware, format_bytes
from ..costs.placement import (
    GRADIENT_SLOTS,
    STAGED_PACKS,
    STASH_SLOTS,
    HostMemoryError,
    PackBytes,
    Placement,
    most_in_window,
    place_state,
    staged_at_once,
)
from ..costs.spec import ModelSpec, Tie, dtype_bytes
from ..graph import ACT_IN, ACT_OUT, DISK_IN, DISK_OUT, OPT_IN, STASH_OUT
from ..plan import Pack, Plan
from .state import host_state


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
        least = stash + gradients + staged_at_once([p.total for p in movable])
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


def gradients_per_pack(spec: ModelSpec, plan: Plan) -> list[int]:
    """Host bytes of each backward pack's gradients held in its slot: less those
    of the ties across packs (held for the step)."""
    master = dtype_bytes(spec.master_dtype or spec.param_dtype)
    tied = {tie.layers[0]: tie.numel * master for tie in tied_across_packs(spec, plan)}
    return [
        host_state(spec, range(a, b)).gradients - sum(n for i, n in tied.items() if a <= i < b)
        for a, b in plan.bwd_packs
    ]


def windowed_gradients(spec: ModelSpec, plan: Plan) -> int:
    """Host bytes of gradients held in :data:`GRADIENT_SLOTS` slots: the most that
    many neighbouring packs' take (the packs' gradients arrive one pack after the
    other, and each pack's wait for the update of the pack that many before it),
    and the ties' across packs for the step."""
    master = dtype_bytes(spec.master_dtype or spec.param_dtype)
    tied = sum(tie.numel * master for tie in tied_across_packs(spec, plan))
    return most_in_window(gradients_per_pack(spec, plan), GRADIENT_SLOTS) + tied


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
    weights = disk_weights(spec, plan, placement)
    reads = sum(n * sum(weights[q] for q in weight_packs(spec, plan, p)) for p, n in loads)
    ride = placement.weights_with_update
    for q, n in backward:
        packs = weight_packs(spec, plan, plan.bwd_packs[q])
        reads += n * sum(weights[o] for o in packs if not (ride and o == q))
    return {
        DISK_IN: float(placement.read_bytes_per_step + reads),
        DISK_OUT: float(placement.write_bytes_per_step),
    }


def disk_weights(spec: ModelSpec, plan: Plan, placement: Placement) -> list[int]:
    """Per backward pack, the bytes of its master weights on disk (0: in host memory)."""
    return [
        host_state(spec, range(*p)).weights if placement.where(q, "weights") == "disk" else 0
        for q, p in enumerate(plan.bwd_packs)
    ]
