"""Checks of a tier's directory before the first step, so that a run that
cannot keep its state on disk says so (naming the path, what is needed and
what is free) before it has trained anything."""

from __future__ import annotations

import os
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


def check_room(directory: Path, need: int, what: str) -> None:
    """Refuse a filesystem without ``need`` bytes free, saying what and how much."""
    free = shutil.disk_usage(directory).free
    if need > free:
        raise DiskTierError(
            f"disk tier {directory}: {what} needs {format_bytes(need)} on disk "
            f"but the filesystem has {format_bytes(free)} free: free space or "
            "give a directory on a larger disk"
        )
