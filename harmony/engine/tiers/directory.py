"""Checks of a tier's directory before the first step, so that a run that
cannot keep its state on disk says so (naming the path, what is needed and
what is free) before it has trained anything."""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

from ...costs.hardware import format_bytes
from .files import DiskTierError


def usable_directory(directory: str | Path, create: bool) -> Path:
    """``directory`` as a writable directory (made if ``create`` and its parent
    exists), or a :class:`DiskTierError` saying what is wrong with it."""
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise DiskTierError(f"disk tier {path} is a file; give a directory")
    if not path.exists():
        if not create:
            raise DiskTierError(
                f"disk tier {path} does not exist: nothing to resume "
                "(DiskTier.create starts a run)"
            )
        if not path.parent.is_dir():
            raise DiskTierError(
                f"disk tier {path} does not exist, nor does its parent "
                f"{path.parent}: create the parent directory first (the tier "
                "makes only the last level)"
            )
        try:
            path.mkdir()
        except OSError as err:
            raise DiskTierError(f"disk tier: cannot create {path} ({err.strerror})") from None
    # os.access alone misses read-only mounts and ACLs, and root passes it always: also
    # write a file
    probe = path / f".probe-{os.getpid()}-{threading.get_ident()}"
    try:
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise DiskTierError(
            f"disk tier {path} is not writable ({err.strerror}): give a "
            "directory this process can write, on a filesystem mounted "
            "read-write"
        ) from None
    finally:
        probe.unlink(missing_ok=True)
    return path


def check_directory(directory: str | Path) -> Path:
    """That a tier could be made in ``directory`` (it, or its parent if it is not
    there yet, is a directory this process can write), changing nothing there."""
    path = Path(directory).expanduser().absolute()
    if path.exists() or not path.parent.is_dir():
        return usable_directory(path, create=False) if path.is_dir() else _missing(path)
    usable_directory(path.parent, create=False)
    return path


def _missing(path: Path) -> Path:
    if path.exists():
        raise DiskTierError(f"disk tier {path} is a file; give a directory")
    raise DiskTierError(
        f"disk tier {path} does not exist, nor does its parent {path.parent}: create the "
        "parent directory first (the tier makes only the last level)"
    )


def check_room(directory: Path, need: int, what: str) -> None:
    """Refuse a filesystem without ``need`` bytes free, saying what and how much."""
    free = shutil.disk_usage(directory).free
    if need > free:
        raise DiskTierError(
            f"disk tier {directory}: {what} needs {format_bytes(need)} on disk "
            f"but the filesystem has {format_bytes(free)} free: free space or "
            "give a directory on a larger disk"
        )


def check_state_room(
    directory: Path, state_bytes: int, slots: int, slot_file: re.Pattern, scratch: int = 0
) -> None:
    """Room for ``slots`` copies of ``state_bytes`` and ``scratch`` bytes of a step's
    stashes, less what the tier's files there (named as ``slot_file`` matches)
    already take."""
    if state_bytes < 0 or scratch < 0:
        raise DiskTierError(
            f"disk tier: state_bytes and scratch must be >= 0, got {state_bytes}, {scratch}"
        )
    have = sum(p.stat().st_size for p in directory.iterdir() if slot_file.match(p.name))
    what = f"the state ({format_bytes(state_bytes)} x {slots} slots, double buffered" + (
        f", less the {format_bytes(have)} its files there take)" if have else ")"
    )
    stashes = f"a step's stashes ({format_bytes(scratch)})"
    if scratch:
        what = f"{what} and {stashes}" if state_bytes or have else stashes
    check_room(directory, slots * state_bytes + scratch - have, what)
