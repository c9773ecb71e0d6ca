"""A model of a slower machine for the benches: this process and everything it
starts afterwards (JupyterLab, the kernel, Chromium, worker processes) share
``cpus`` cores' worth of CPU time, through a Linux cgroup's CPU quota.

A model, not a slower machine: the quota lets the processes run at full speed
in each 10 ms period until they have used their share, then stops them until
the next one, where a slower core would run them at a slower pace throughout.
bench/RESULTS.md says which quota matched which machine's measurements.

Needs write access to the cgroup file system's CPU controller (root, on most
Linux machines); the context manager says what was missing otherwise."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PERIOD_US = 10_000  #: the quota's period: short, so that a stop lasts at most this long
ROOT = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def cpu_quota(cpus: float | None):
    """Run the body (and what it starts) on ``cpus`` cores' worth of time; None: as
    the machine is."""
    if cpus is None:
        yield
        return
    if cpus <= 0:
        raise SystemExit(f"--cpus {cpus}: give a positive number of cores, e.g. 0.5")
    v2 = (ROOT / "cgroup.controllers").exists()
    parent = ROOT if v2 else ROOT / "cpu"
    group = parent / f"harmony-bench-{os.getpid()}"
    quota = max(1000, round(cpus * PERIOD_US))
    try:
        group.mkdir()
        if v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as err:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise SystemExit(
            f"--cpus needs a cgroup of its own with a CPU quota, and could not make one "
            f"({err}): run as root on Linux, with the cgroup CPU controller mounted at "
            f"{parent}; or leave --cpus out to measure the machine as it is"
        ) from None
    print(
        f"CPU quota: {cpus:g} cores' worth of time ({quota} us per {PERIOD_US} us), "
        "a model of a slower machine"
    )
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            (parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()  # fails while a process started in it lives on: left for the OS
