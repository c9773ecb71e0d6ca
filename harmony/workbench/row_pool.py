"""An explorer's comparison rows simulated side by side.

After a control changes, the explorer needs every policy's row: the faithful
baselines' choosers (each simulates candidates until one fits) and one plan per
policy on the controls. They are independent, so forked worker processes
simulate them while the explorer plays the chosen plan itself (whose trace it
draws); what the workers found goes into the kept results of
:mod:`~harmony.workbench.play`, where the rows are then read. A worker returns
plans and summaries, a few hundred bytes each, never a trace.

With one core, or where processes cannot be forked, nothing is sent and the
rows are simulated one after another, as before. The same results either way:
the workers run the same functions on the same arguments (models and servers by
name: the catalog and the presets are fixed tables, read by the workers as they
were when forked). A worker that dies leaves its rows to this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..costs.hardware import Hardware
from ..plan import Plan
from . import play

#: at most this many workers, however many cores
MAX_WORKERS = 4
_EXECUTOR: ProcessPoolExecutor | None = None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pool() -> ProcessPoolExecutor | None:
    """The workers, forked on first use (the simulator is pure Python: nothing of
    torch or the kernel's sockets is used in them), or None with one core."""
    global _EXECUTOR
    n = min(MAX_WORKERS, cores())
    if n < 2 or "fork" not in mp.get_all_start_methods():
        return None
    if _EXECUTOR is None:
        _EXECUTOR = ProcessPoolExecutor(n, mp_context=mp.get_context("fork"))
    return _EXECUTOR


def _chosen(args: tuple):
    """In a worker: a baseline's own plan for ``args`` (as :func:`play.own_plan`'s) and
    the summary its chooser saw of it."""
    plan, problem = play.own_plan(*args)
    if plan is None:
        return plan, problem, None
    _, model, source, hardware, _, _, host_memory, disk = args
    hw = play.server(hardware, host_memory, disk)
    return plan, problem, ((model, source, hw, plan), play.own_summary(model, source, hw, plan))


def _summary(model: str, source: str, hw: Hardware, plan: Plan):
    """In a worker: :func:`play.played_summary`, the trace not kept."""
    trace, problem = play.play(play.cached_spec(model, source), hw, plan)
    return (trace.summary if trace is not None else None), problem


class Rows:
    """Rows being simulated by the workers: ``choosers`` (the arguments of
    :func:`play.own_plan`, all eight) and ``plays`` ((model, source, hardware,
    plan) each, as :func:`play.played_summary`'s), each sent unless its result
    is kept already. :meth:`wait` puts what they found where the explorer reads."""

    def __init__(self, choosers: list[tuple], plays: list[tuple]):
        self.sent: list[tuple] = []
        pool = _pool()
        if pool is None:
            return
        try:
            for args in dict.fromkeys(choosers):
                if args not in play.OWN_PLANS:
                    self.sent.append(("chooser", args, pool.submit(_chosen, args)))
            for args in dict.fromkeys(plays):
                if args not in play.PLAYED and args not in play.TRACES:
                    self.sent.append(("play", args, pool.submit(_summary, *args)))
        except BrokenProcessPool:
            _forget_pool()

    def wait(self) -> None:
        """Wait for the workers and keep what they found. A worker that died (the
        pool broken) leaves its rows to be simulated here."""
        try:
            for what, args, future in self.sent:
                if what == "chooser":
                    plan, problem, picked = future.result()
                    play.OWN_PLANS.put(args, (plan, problem))
                    if picked is not None:
                        play.PICKED.put(*picked)
                else:
                    play.PLAYED.put(args, future.result())
        except BrokenProcessPool:
            _forget_pool()


def _forget_pool() -> None:
    global _EXECUTOR
    if _EXECUTOR is not None:
        _EXECUTOR.shutdown(wait=False, cancel_futures=True)
    _EXECUTOR = None
