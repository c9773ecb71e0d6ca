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
    so reference counting frees it all the same."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
