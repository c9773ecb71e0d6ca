"""An explorer's comparison rows simulated side by side.

After a control changes, the explorer needs every policy's row: the faithful
baselines' choosers (each simulates candidates until one fits) and one plan per
policy on the controls. They are independent, so forked worker processes
simulate them while the explorer plays the chosen plan itself (whose trace it
draws); what the workers found goes into the kept results of
:mod:`~harmony.workbench.play`, where the rows are then read. A worker returns
plans and summaries, a few hundred bytes each, never a trace.

While the reader looks at an update, with cores to spare (:data:`AHEAD_FROM_CORES`),
one more worker simulates ahead the rows
of the settings the explorer expects next (:func:`ahead`: the plans of the
controls one step either way). A change that lands on one finds its rows kept,
or being simulated already; the others' rows not started yet are dropped at
the change. That worker has a pool of its own, so that a change's rows never
queue behind rows simulated ahead, and the lowest priority (:data:`AHEAD_NICE`),
behind the explorer's kernel and the browser, which draw the update meanwhile,
and behind the change's own workers (they run at the kernel's priority: what a
change needs is never left waiting for other work on the machine).

With one core, or where processes cannot be forked, nothing is sent and the
rows are simulated one after another, as before (and nothing ahead). The same results either way:
the workers run the same functions on the same arguments (models and servers by
name: the catalog and the presets are fixed tables, read by the workers as they
were when forked). A worker that dies leaves its rows to this process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..costs.hardware import Hardware
from ..plan import Plan
from . import play

#: at most this many workers, however many cores
MAX_WORKERS = 4
#: the niceness of the worker that simulates rows ahead (:func:`_behind_the_reader`):
#: behind everything else
AHEAD_NICE = 19
#: rows simulated ahead at most, waiting or running
MAX_AHEAD = 48
#: rows are simulated ahead with this many cores or more. With two, the worker ahead takes
#: a core the browser needs to draw an update, however low its priority: on a 2-core VM
#: every change not one step away took 50-90 ms longer with it, a step change 20-140 ms
#: less (bench/RESULTS.md)
AHEAD_FROM_CORES = 4
#: whether rows are simulated ahead: True, False, or None (with :data:`AHEAD_FROM_CORES`
#: cores or more); ``HARMONY_EXPLORER_AHEAD`` = ``1``, ``0`` or ``auto`` (the default)
AHEAD = {"1": True, "0": False}.get(os.environ.get("HARMONY_EXPLORER_AHEAD", "auto"))
_EXECUTOR: ProcessPoolExecutor | None = None
_AHEAD_EXECUTOR: ProcessPoolExecutor | None = None
#: rows sent ahead, by ("chooser" or "play", arguments): their futures
_AHEAD: dict[tuple, Future] = {}


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


def _ahead_pool() -> ProcessPoolExecutor | None:
    """The worker that simulates rows ahead (with the others, None where they are)."""
    global _AHEAD_EXECUTOR
    if _pool() is None:
        return None
    if _AHEAD_EXECUTOR is None:
        _AHEAD_EXECUTOR = ProcessPoolExecutor(
            1, mp_context=mp.get_context("fork"), initializer=_behind_the_reader
        )
    return _AHEAD_EXECUTOR


def _behind_the_reader() -> None:
    """In the worker ahead, first: the lowest priority. Linux schedules sessions
    against each other (autogroups): a niceness counts only against the processes
    of one's own session, which the browser's is not. A session of its own, with the
    niceness of its group raised too, puts the worker behind the browser as well
    (where the system allows it; the niceness alone elsewhere)."""
    os.nice(AHEAD_NICE)
    with contextlib.suppress(OSError, AttributeError):
        os.setsid()
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(AHEAD_NICE))


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
    is kept already or it was sent :func:`ahead` (then that one is waited for).
    :meth:`wait` puts what they found where the explorer reads."""

    def __init__(self, choosers: list[tuple], plays: list[tuple]):
        self.sent: list[tuple] = []
        pool = _pool()
        if pool is None:
            return
        wanted = [("chooser", args) for args in dict.fromkeys(choosers)]
        wanted += [("play", args) for args in dict.fromkeys(plays)]
        wanted = [key for key in wanted if not _kept(key)]
        taken = {key: _AHEAD.pop(key) for key in wanted if key in _AHEAD}
        _drop_waiting()  # before these are sent: nothing queues ahead of them
        try:
            for key in wanted:
                what, args = key
                future = taken.get(key)
                if future is None or future.cancelled():
                    future = pool.submit(*_job(key))
                self.sent.append((what, args, future))
        except BrokenProcessPool:
            _forget_pool()

    def wait(self) -> None:
        """Wait for the workers and keep what they found. A worker that died (the
        pool broken) leaves its rows to be simulated here."""
        try:
            for what, args, future in self.sent:
                _keep((what, args), future.result())
        except BrokenProcessPool:
            _forget_pool()
        harvest()


def _job(key: tuple) -> tuple:
    """The function and arguments that simulate the row ``key`` in a worker."""
    what, args = key
    return (_chosen, args) if what == "chooser" else (_summary, *args)


def _kept(key: tuple) -> bool:
    """Whether the row ``key`` is kept in :mod:`play` (nothing to simulate)."""
    what, args = key
    if what == "chooser":
        return args in play.OWN_PLANS
    return args in play.PLAYED or args in play.TRACES


def _keep(key: tuple, result) -> None:
    """Put what a worker found for the row ``key`` where the explorer reads it."""
    what, args = key
    if what == "chooser":
        plan, problem, picked = result
        play.OWN_PLANS.put(args, (plan, problem))
        if picked is not None:
            play.PICKED.put(*picked)
    else:
        play.PLAYED.put(args, result)


def ahead_on() -> bool:
    """Whether :func:`ahead` sends anything: :data:`AHEAD` (or, where it is None, the
    cores for it), and workers to send it to."""
    wanted = AHEAD if AHEAD is not None else cores() >= AHEAD_FROM_CORES
    return wanted and _ahead_pool() is not None


def ahead(choosers: list[tuple], plays: list[tuple]) -> int:
    """Send rows the explorer expects to need next (as :class:`Rows` takes them) to
    the workers, unless kept or sent already, up to :data:`MAX_AHEAD` in all;
    returns how many were sent. Their results are kept as they come
    (:func:`harvest`), or waited for by the change that needs them."""
    if not ahead_on():
        return 0
    pool = _ahead_pool()
    harvest()
    keys = [("chooser", args) for args in dict.fromkeys(choosers)]
    keys += [("play", args) for args in dict.fromkeys(plays)]
    sent = 0
    try:
        for key in keys:
            if len(_AHEAD) >= MAX_AHEAD:
                break
            if key not in _AHEAD and not _kept(key):
                _AHEAD[key] = pool.submit(*_job(key))
                sent += 1
    except BrokenProcessPool:
        _forget_pool()
    return sent


def harvest() -> None:
    """Keep the results of the rows sent ahead that are done (one that failed is
    simulated again when a change needs it, and says why there)."""
    for key, future in list(_AHEAD.items()):
        if not future.done():
            continue
        del _AHEAD[key]
        if not future.cancelled() and future.exception() is None:
            _keep(key, future.result())


def _drop_waiting() -> None:
    """Cancel the rows sent ahead that no worker has started (those running finish,
    and are kept)."""
    for key, future in list(_AHEAD.items()):
        if future.cancel():
            del _AHEAD[key]


def _forget_pool() -> None:
    global _EXECUTOR, _AHEAD_EXECUTOR
    _AHEAD.clear()
    for pool in (_EXECUTOR, _AHEAD_EXECUTOR):
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    _EXECUTOR = _AHEAD_EXECUTOR = None
