"""One training step, played with real tensors: :class:`~.run.StepRun` and the
parts it is made of (see :mod:`.run`)."""

from .run import SharedDevices, StepRun, memory_checks

__all__ = ["SharedDevices", "StepRun", "memory_checks"]
