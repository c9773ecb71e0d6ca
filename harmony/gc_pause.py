"""Pausing Python's cyclic garbage collector while a graph is built or played, and
keeping it off what an interactive session made before its first control."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Within it, Python's cyclic garbage collector does not run. Building and
    playing a graph make tens of thousands of lists and tuples, and each round of
    the collector then walks every object the process holds (torch's included):
    in a search that was a good part of the time. What they make has no cycles,
    so reference counting frees it all the same."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_settled = False


def settle_long_lived() -> None:
    """Once per process: collect, then leave everything the process holds now out of
    the collector's sight (``gc.freeze``). An explorer's kernel holds half a million
    objects by its first chart (torch, pandas, altair, the notebook's own), and a
    full collection walks them all: 0.5 s, in the middle of a control's update, every
    few updates. Frozen objects are still freed by reference counting; what is
    garbage now is collected first, so none is kept."""
    global _settled
    if _settled or not gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    _settled = True
