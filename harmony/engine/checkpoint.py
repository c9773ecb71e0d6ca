"""Checkpoint files: an engine's whole training state, written so that a crash
at any moment never leaves a reader a half-written file, and verified on load.

A checkpoint file is a header line, a JSON line (format, payload size, SHA-256
of the payload) and the payload: the state as ``torch.save`` writes it, loaded
back with ``weights_only=True`` (tensors, numbers, strings and containers
only, so loading a file runs no code from it).

Writes go to a temporary file in the same directory, are flushed to disk
(fsync) and renamed over the target: a reader sees the old file or the new
one, never a mixture. :class:`CheckpointDir` keeps the last ``keep`` of a run
and, on resume, falls back past a damaged newest one to the newest good one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch

from ..errors import HarmonyError
from .tiers.system import fsync_dir

MAGIC = b"harmony-checkpoint\n"
FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.ckpt$")


class CheckpointError(HarmonyError):
    """A checkpoint that cannot be used: missing, truncated, corrupted or for another run."""


def write_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` to ``path`` atomically, with a checksum."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory; give a file name such as {path / 'engine.ckpt'}"
        )
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot write {path}: directory {path.parent} does not exist")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = json.dumps(
        {"format": FORMAT, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    ).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + header + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)  # the rename itself survives a power cut
    return path


def read_checkpoint(path: str | Path) -> dict:
    """The state in ``path``, after checking it is whole and unchanged."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(
            f"{path} is not a harmony checkpoint (it does not start with the checkpoint header)"
        )
    header_end = data.find(b"\n", len(MAGIC))
    if header_end < 0:
        raise CheckpointError(f"checkpoint {path} is truncated: it ends inside its header")
    try:
        header = json.loads(data[len(MAGIC) : header_end])
        size, digest, version = int(header["bytes"]), str(header["sha256"]), int(header["format"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its header is unreadable"
        ) from None
    if version != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {version}; this harmony reads format {FORMAT}"
        )
    payload = data[header_end + 1 :]
    if len(payload) != size:
        raise CheckpointError(
            f"checkpoint {path} is truncated: {len(payload)} of {size} bytes; "
            "use an earlier checkpoint of the run"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its checksum does not match its contents; "
            "use an earlier checkpoint of the run"
        )
    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except (
        Exception
    ) as err:  # a payload that checks but does not load was written by something else
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from None


class CheckpointDir:
    """The checkpoints of one run: ``step-NNNNNNNN.ckpt`` files in ``directory``,
    the last ``keep`` of them kept."""

    def __init__(self, directory: str | Path, keep: int = 3):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise CheckpointError(f"keep must be a positive number of checkpoints, got {keep!r}")
        self.directory, self.keep = Path(directory), keep
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"checkpoint directory {self.directory} is a file; give a directory"
            )

    def paths(self) -> list[Path]:
        """Checkpoints of the run, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            (int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))
        ]
        return [p for _, p in sorted(found)]

    def save(self, state: dict, step: int) -> Path:
        """Write the checkpoint of ``step``, then drop all but the last ``keep``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".step-*.ckpt.tmp-*"):  # left by a writer that was killed
            stale.unlink(missing_ok=True)
        path = write_checkpoint(self.directory / f"step-{step:08d}.ckpt", state)
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self, log: Callable[[str], None] = print) -> tuple[Path, dict] | None:
        """The newest checkpoint that reads back whole, and its state; damaged newer
        ones are reported through ``log`` and left in place for inspection."""
        for path in reversed(self.paths()):
            try:
                return path, read_checkpoint(path)
            except CheckpointError as err:
                log(f"skipping {err}")
        return None
