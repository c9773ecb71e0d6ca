"""What one training step reads of the engine that runs it: :class:`StepContext`.

The engine makes one for every step (:meth:`~harmony.engine.Engine.step_context`):
the plan, the optimizers and the loss scale may change between steps, never
during one. The step's code (:mod:`.step`: :class:`~.step.run.StepRun` and its parts)
reads nothing else of the engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..plan import Plan
from .devices import Backend
from .host_model import HostModel
from .journal import UpdateJournal

if TYPE_CHECKING:
    from .disk_staging import StateOnDisk
    from .distributed import GradientSync
    from .gradient_slots import GradientSlots


@dataclass(frozen=True)
class StepContext:
    host: HostModel
    backends: list[Backend]  # the engine's own devices
    plan: Plan
    #: (pack, shard) -> the optimizer of those parameters (None: a pack without any)
    optimizers: dict[tuple[int, int], torch.optim.Optimizer | None]
    loss_fn: Callable
    model_name: str  # for the trace
    #: the dtype weights, activations and gradients cross the links and are computed in
    #: under mixed precision; None: float32 throughout
    compute_dtype: torch.dtype | None
    #: BatchNorm's parameters and statistics per layer, which keep their dtype under it
    norm_tensors: list[set[str]]
    loss_scale: float  # fp16's dynamic loss scale (1: none)
    seed: int
    step: int  # dropout masks are seeded per (seed, step, microbatch, layer)
    #: held while seeding and running a layer that draws random numbers, when several
    #: compute threads share torch's generator
    rng_lock: threading.Lock
    #: records what updates change, to undo a failed step (None: safe_updates off)
    journal: UpdateJournal | None
    sync: "GradientSync | None"  # gradients averaged across servers (None: one server)
    #: the state kept on a disk tier, read and written by DISK_IN / DISK_OUT (None: none)
    disk: "StateOnDisk | None" = None
    #: host gradients held in pack-sized slots (None: one buffer for the whole model)
    gradient_slots: "GradientSlots | None" = None
    #: a weight load's cast to the compute dtype is kept, in page-locked host memory,
    #: for the pack's next load in the same step (its backward's): one cast per step, not
    #: one per load, and none beside the backward's updates. The step's weights change
    #: only by its own updates, after each pack's last load, so a kept cast is never
    #: stale; none is kept from one step to the next, when anything may change them. It
    #: holds up to one compute-dtype copy of the model's weights: on where there is no
    #: host memory budget (host_memory=) nor disk tier.
    keep_casts: bool = False
