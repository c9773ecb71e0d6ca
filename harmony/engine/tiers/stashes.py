"""Stashes (and offloaded activations) of a step on disk: :class:`StashFile`.

Where even the training state on disk leaves too little host memory for the
minibatch's stashed pack inputs (``Placement.stashes_on_disk``), each piece
that reaches host memory is written to one scratch file in the tier's
directory and read back before its copy to a GPU. Nothing in it outlives the
step that wrote it, so it is not part of the committed state: no checksum,
no second slot, and a run that is killed leaves only a file the next run
truncates. Each tensor starts at a page, as direct I/O needs; a read of a
sample range reads the rows it needs (batch is dimension 0) from the page
the first of them is on, through the tier's :class:`~.files.ChunkIO`, so an
emulated disk link paces stash traffic and state traffic as one disk.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import PAGE, ChunkIO, byte_view, round_up

#: the scratch file's name in the tier's directory
STASH_FILE = "stashes.scratch"


@dataclass(frozen=True)
class Piece:
    """One tensor of a stash on disk: where it starts, its dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n


def scratch_bytes(stash_bytes: int, pieces: int) -> int:
    """Room the scratch file takes for ``stash_bytes`` of a step's stashes in
    ``pieces`` pieces (each tensor padded to a page; one tensor a piece)."""
    return stash_bytes + pieces * PAGE


class StashFile:
    """The scratch file of ``directory`` (the tier checks the room it needs:
    :func:`scratch_bytes`), moved through ``io``. Pieces are written where the
    file ends; the file starts again from its beginning at each step
    (:meth:`new_step`)."""

    def __init__(self, io: ChunkIO, directory: Path):
        self.path = directory / STASH_FILE
        self.io = io
        self.fd = io.open(self.path, write=True)
        os.ftruncate(self.fd, 0)
        self.end = 0
        self._lock = threading.Lock()

    def new_step(self) -> None:
        """A step starts: what the last one wrote is no longer needed."""
        with self._lock:
            self.end = 0

    def write(self, value: tuple) -> tuple[Piece | None, ...]:
        """Write the tensors of ``value`` (None stays None); where each went."""
        out = []
        for t in value:
            if t is None:
                out.append(None)
                continue
            t = t.detach().contiguous()
            n = t.numel() * t.element_size()
            with self._lock:
                offset, self.end = self.end, self.end + round_up(max(n, 1), PAGE)
            if n:
                self.io.write(self.fd, offset, [(0, byte_view(t))], n, checksum=False)
            out.append(Piece(offset, t.dtype, tuple(t.shape)))
        return tuple(out)

    def read(self, pieces: tuple[Piece | None, ...], rows: tuple[int, int]) -> tuple:
        """Rows ``[rows[0], rows[1])`` of the tensors written as ``pieces``, in new
        host memory."""
        r0, r1 = rows
        out = []
        for p in pieces:
            if p is None:
                out.append(None)
                continue
            t = torch.empty((r1 - r0, *p.shape[1:]), dtype=p.dtype)
            n = t.numel() * t.element_size()
            if n:
                start = p.offset + r0 * p.row_bytes
                head = start % PAGE  # from the page the first row is on
                skipped = memoryview(bytearray(head))
                parts = [(0, skipped), (head, byte_view(t))] if head else [(0, byte_view(t))]
                self.io.read(self.fd, start - head, parts, head + n, checksum=False)
            out.append(t)
        return tuple(out)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)
