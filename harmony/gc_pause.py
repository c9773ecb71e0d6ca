"""Pausing Python's cyclic garbage collector while a graph is built or played."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Within it, Python's cyclic garbage collector does not run. Building and
    playing a graph make tens of thousands of lists and tuples, and each round of
    the collector then walks every object the process holds (torch's included):
    in a search that was a good part of the time. What they make has no cycles,
    so reference counting frees it all the same.

    On the way out, what was made inside goes straight to the collector's oldest
    generation (:func:`_age_young_objects`), so that the first allocation after it
    does not walk the fresh graph (some 18,000 objects for GPT-2 XL on 4 GPUs): with
    torch loaded, that took one plan's build, play and summary from about what it costs
    with the collector off to 8% more (bench/RESULTS.md)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        _age_young_objects()
        gc.enable()


def _age_young_objects() -> None:
    """Move every object the collector tracks to its oldest generation without a
    collection (``gc.freeze`` then ``gc.unfreeze`` move lists, they visit no object)
    and zero the count that would start the next one. A young object of the caller's
    that has become cyclic garbage then waits for the next full collection instead of
    the next young one. Skipped where the process has frozen objects itself (a server
    before it forks, say): unfreezing would undo that."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
