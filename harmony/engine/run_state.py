"""Where a run is: :class:`RunState`, the few values an engine's run carries from
step to step and a checkpoint saves (the tensors are the model's and the
optimizers')."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..errors import NonFiniteError
from ..plan import Plan

#: fp16's loss scale doubles after this many good steps in a row (as torch.amp.GradScaler)
GROWTH_INTERVAL = 2000


@dataclass
class RunState:
    """The run's counters and settings: steps taken and skipped, the fp16 loss
    scale and the good steps since it last changed, the seed, the precision, the
    minibatch size and the plan (None until one is set or searched)."""

    seed: int
    minibatch_size: int
    precision: str
    plan: Plan | None = None
    step_count: int = 0
    skipped_steps: int = 0
    loss_scale: float = 1.0
    good_steps: int = 0

    def stepped(self) -> None:
        """A step was applied: counted, and under fp16 dynamic loss scaling the scale
        doubles after :data:`GROWTH_INTERVAL` good steps."""
        self.step_count += 1
        if self.loss_scale != 1.0:
            self.good_steps += 1
            if self.good_steps == GROWTH_INTERVAL:
                self.loss_scale *= 2
                self.good_steps = 0

    def skipped(self, err: NonFiniteError, nonfinite: str) -> None:
        """A step found a non-finite loss or gradient (and was rolled back): an fp16
        overflow halves the scale; otherwise ``nonfinite`` says: ``"raise"`` ``err``,
        or ``"skip"`` with a warning. A skipped step is counted."""
        if self.loss_scale != 1.0 and err.what == "gradient":
            # fp16 overflow: a smaller scale next time
            self.loss_scale /= 2
            self.good_steps = 0
        elif nonfinite == "raise":
            raise err from None
        else:
            warnings.warn(
                f"step {self.step_count} skipped, weights unchanged: {err}", stacklevel=3
            )
        self.step_count += 1
        self.skipped_steps += 1


def run_field(name: str) -> property:
    """A property that reads and writes ``name`` of its owner's ``run_state``."""
    return property(
        lambda owner: getattr(owner.run_state, name),
        lambda owner, value: setattr(owner.run_state, name, value),
        doc=f"The run's ``{name}`` (see :class:`RunState`).",
    )
