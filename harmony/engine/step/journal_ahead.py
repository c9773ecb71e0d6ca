"""The update journal's copies made ahead of the updates, while the forward runs.

A step's updates overlap the backward, and each one journaled (started while
other tasks may still fail) first copies its pack's weights and optimizer state:
as many bytes again as the update itself moves, on the host lane that is the
step's critical path once a GPU computes the backward faster than the host
updates. During the forward that lane has nothing to do. :class:`JournalAhead`
copies the packs there, in the order their updates will come, until the first
update begins; each update then takes its copy as made (see
:meth:`~harmony.engine.journal.UpdateJournal.record_ahead`). The copies of updates
that turn out not to be journaled (past the point of no return) are never used.
"""

from __future__ import annotations

import threading

from ..context import StepContext
from .updates import Updates


class JournalAhead:
    """A thread copying, for ``ctx``'s journal, the packs of ``updates``' host
    updates in ``seq`` order, until one of them has begun or :meth:`stop`."""

    def __init__(self, ctx: StepContext, updates: Updates):
        self.ctx, self.updates = ctx, updates
        self.order = sorted(updates.host_updates, key=lambda t: t.seq)
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="harmony-journal-ahead", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            for task in self.order:
                if self.stopped.is_set() or self.updates.claimed:
                    return  # the updates have begun: from here each copies its own
                key = (task.pack, task.data.shard[0])
                opt = self.ctx.optimizers[key]
                if opt is not None:
                    self.ctx.journal.record_ahead(key, opt)
        except BaseException as err:  # raised on the step's thread, by stop()
            self.error = err

    def stop(self, raise_error: bool = True) -> None:
        """No more copies; with ``raise_error``, raise what stopped the thread, if anything."""
        self.stopped.set()
        self.thread.join()
        if raise_error and self.error is not None:
            raise self.error
