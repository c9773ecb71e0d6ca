"""Training state on disk, per layer pack, crash-safe: :class:`DiskTier`.

Layout of the directory::

    manifest.json        the committed step and, per (pack, kind), its two slots
    pack-3.optimizer.0   slot 0 of pack 3's optimizer state
    pack-3.optimizer.1   slot 1 (the other generation)
    pack-3-1.weights.0   pack 3, data-parallel shard 1, master weights ...

Each (pack, kind) is double buffered. A write goes to the slot the committed
state is *not* in (the same one again if the pack is written twice in a
step), payload first, then its header (magic line + JSON: the layout of the
tensors and a CRC-32 per chunk), then ``fsync``. :meth:`DiskTier.commit`
then writes a new ``manifest.json`` atomically (temp file, fsync, rename,
fsync of the directory) naming, for every (pack, kind), the step and
checksums of each slot and which slot is current. A kill at any moment
leaves the previous manifest, whose slots no write touched, or the new one,
whose slots were all on disk before it was: never a mixture of steps.

The manifest keeps both slots of a (pack, kind): its two latest writes. So
the tier can also go back one step, to the step of the engine's own last
checkpoint (:mod:`harmony.engine.checkpoint`) when a kill came between the
tier's commit and that checkpoint: ``DiskTier.open(path, expect_step=N)``
takes, for every (pack, kind), the latest write at or before step N, checks
it against the manifest's checksums, and forgets what is newer. A slot whose
checksums fail (a write of the next step was under way) or whose step is
newer than N is not used; if step N's state is no longer whole, it says so.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Mapping

import torch

from ...costs.hardware import format_bytes, parse_rate
from ...errors import HarmonyError
from .budget import HostBudget
from .directory import check_state_room, usable_directory
from .files import (
    CHUNK,
    PAGE,
    ChunkIO,
    DiskTierError,
    Entry,
    byte_view,
    fsync_dir,
    header_bytes,
    layout_of,
    no_space,
    round_up,
    segments,
    write_atomic,
)
from .staging import StagedState, Staging

MANIFEST = "manifest.json"
FORMAT = 1
SLOTS = 2
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")
_SLOT_FILE = re.compile(r"^pack-[0-9-]+\.[a-z][a-z0-9_]*\.[01]$")

Pack = int | tuple[int, ...]


def pack_name(pack: Pack) -> str:
    """``3`` -> ``"3"``; ``(3, 1)`` (pack 3, data-parallel shard 1) -> ``"3-1"``."""
    parts = pack if isinstance(pack, tuple) else (pack,)
    if not parts or not all(
        isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts
    ):
        raise DiskTierError(
            f"a pack is a number >= 0 or a tuple of them, e.g. 3 or (3, 1); got {pack!r}"
        )
    return "-".join(str(p) for p in parts)


class DiskTier:
    """Per-pack training state in a directory (see the module docstring).

    Make one with :meth:`create` (a new run) or :meth:`open` (resume). Per
    training step: :meth:`read` each on-disk (pack, kind) when its update
    needs it, :meth:`write` it back after the update, then :meth:`commit` the
    step. Reads and writes of different (pack, kind) may run on different
    threads at once; one (pack, kind) is read or written by one at a time.

    ``budget``: the :class:`HostBudget` that the tier's host buffers are
    charged to. ``read_rate`` / ``write_rate``: pace the disk to these
    bandwidths (bytes/s or ``"2GB/s"``), like the emulated GPU links;
    ``shared``: its reads and writes share the disk's time (a read and a write
    at once take the sum of their times alone; :class:`~.files.ChunkIO`).
    ``threads``: requests in flight, each through an aligned buffer of
    ``chunk`` bytes, the bytes per request and per checksum. ``direct``:
    bypass the page cache where the filesystem allows (see
    :mod:`harmony.engine.tiers.files`)."""

    def __init__(
        self,
        directory: Path,
        manifest: dict,
        *,
        budget: HostBudget | None = None,
        read_rate: str | float | None = None,
        write_rate: str | float | None = None,
        shared: bool = False,
        threads: int = 4,
        chunk: int = CHUNK,
        direct: bool = True,
    ):
        self.directory = directory
        self.step: int | None = manifest["step"]  # the last committed step
        self.ignored: list[str] = []  # slots that open did not use, and why
        self._entries: dict[str, dict] = manifest["entries"]  # as in the manifest
        self._pending: dict[str, tuple[int, dict]] = {}  # key -> (slot, record), not committed
        self._busy: set[str] = set()  # keys being read or written
        self._lock = threading.Lock()
        rates = [
            parse_rate(r, f"disk {how} bandwidth") if r else None
            for r, how in ((read_rate, "read"), (write_rate, "write"))
        ]
        self.io = ChunkIO(threads, chunk, *rates, shared=shared, direct=direct)
        self._budget, self._io_name = budget, f"disk tier {directory} I/O buffers"
        self._staging = Staging(budget, f"disk tier {directory}")
        if budget is not None:
            try:
                budget.charge(self._io_name, self.io.buffer_bytes)
            except HarmonyError:
                self.io.close()
                raise

    # ---- making one ---------------------------------------------------------------
    @classmethod
    def create(
        cls, directory: str | Path, *, state_bytes: int = 0, scratch_bytes: int = 0, **options
    ) -> "DiskTier":
        """A tier for a new run in ``directory`` (made if its parent exists),
        checked to be writable and to have room for ``state_bytes`` of state
        (twice: each (pack, kind) keeps two slots) and ``scratch_bytes`` of a
        step's stashes (:class:`~.stashes.StashFile`). It holds nothing until the
        first commit."""
        directory = usable_directory(directory, create=True)
        if (directory / MANIFEST).exists():
            raise DiskTierError(
                f"disk tier {directory} already holds a run ({MANIFEST}): "
                "DiskTier.open resumes it; give an empty directory to start a "
                "new one"
            )
        check_state_room(directory, state_bytes, SLOTS, _SLOT_FILE, scratch_bytes)
        return cls(directory, {"step": None, "entries": {}}, **options)

    @classmethod
    def open(
        cls,
        directory: str | Path,
        *,
        expect_step: int | None = None,
        state_bytes: int = 0,
        scratch_bytes: int = 0,
        **options,
    ) -> "DiskTier":
        """The state committed in ``directory``, as of ``expect_step`` (default:
        the last committed step; give the step of the engine checkpoint being
        resumed, so both agree). The chosen slots are checked against their
        checksums; ``state_bytes`` and ``scratch_bytes`` as in :meth:`create`."""
        directory = usable_directory(directory, create=False)
        manifest = _read_manifest(directory)
        for stale in directory.glob(f".{MANIFEST}.tmp-*"):  # left by a commit that was killed
            stale.unlink(missing_ok=True)
        check_state_room(directory, state_bytes, SLOTS, _SLOT_FILE, scratch_bytes)
        tier = cls(directory, manifest, **options)
        try:
            tier._go_to(manifest["step"] if expect_step is None else expect_step)
        except BaseException:
            tier.close()
            raise
        return tier

    def _go_to(self, step: int) -> None:
        """Keep, per (pack, kind), the latest write at or before ``step`` (checked)
        and the write before it; forget newer ones."""
        committed = self.step
        if not isinstance(step, int) or isinstance(step, bool) or step > committed:
            raise DiskTierError(
                f"disk tier {self.directory} was last committed at step {committed}, and step "
                f"{step!r} was asked for: the tier commits before the engine checkpoints, so a "
                "checkpoint newer than the tier belongs to another run or another directory"
            )
        for key, entry in list(self._entries.items()):
            if entry["created"] > step:  # this state did not exist yet at that step
                self.ignored.append(
                    f"{key}: first written at step {entry['created']}, after step {step}"
                )
                del self._entries[key]
                continue
            slots = entry["slots"]
            for i, rec in enumerate(slots):
                if rec is not None and rec["step"] > step:
                    self.ignored.append(
                        f"{key} slot {i}: holds step {rec['step']}, newer than step {step}"
                    )
                    slots[i] = None
            kept = [i for i, rec in enumerate(slots) if rec is not None]
            if not kept:
                raise DiskTierError(
                    f"disk tier {self.directory}: the state of {key} as of step {step} is gone "
                    f"(the tier keeps the last two writes of each pack and the manifest is at "
                    f"step {committed}); resume from the engine checkpoint of step {committed}"
                )
            entry["current"] = max(kept, key=lambda i: slots[i]["step"])
            self._verify(key, entry["current"], slots[entry["current"]], step)
        self.step = step

    def _verify(self, key: str, slot: int, rec: dict, step: int) -> None:
        """Check that ``slot`` holds what the manifest says, header and payload."""
        path, header = self._path(key, slot), _header(key, rec)
        what = f"{key} as of step {step}"
        try:
            with open(path, "rb") as f:
                found = f.read(len(header))
        except OSError as err:
            raise DiskTierError(
                f"disk tier: cannot read {path} ({err.strerror}), which holds {what}"
            ) from None
        if found != header:
            raise DiskTierError(
                f"disk tier: {path} does not hold what the manifest says "
                f"({what}): it was overwritten or damaged; the state of step "
                f"{step} is lost"
            )
        self._load(key, slot, rec, [], verify=True, what=what)  # the checksums only

    # ---- per step -----------------------------------------------------------------
    def has(self, pack: Pack, kind: str) -> bool:
        key = _key(pack, kind)
        with self._lock:
            return key in self._pending or key in self._entries

    def layout(self, pack: Pack, kind: str) -> tuple[tuple[Entry, ...], int]:
        """The tensors :meth:`read` would return for (``pack``, ``kind``) (name,
        dtype, shape and offset of each) and the payload's size, so a caller can
        read into buffers of its own."""
        with self._lock:
            rec = self._latest(_key(pack, kind), pack, kind)[1]
        return tuple(Entry.from_json(e) for e in rec["layout"]), rec["nbytes"]

    def _latest(self, key: str, pack: Pack, kind: str) -> tuple[int, dict]:
        """The slot and record of ``key``'s latest write (lock held)."""
        if key in self._pending:
            return self._pending[key]
        if key in self._entries:
            entry = self._entries[key]
            return entry["current"], entry["slots"][entry["current"]]
        raise DiskTierError(
            f"disk tier {self.directory} holds no {kind!r} state of pack "
            f"{pack_name(pack)}: write it first"
        )

    def read(
        self,
        pack: Pack,
        kind: str,
        into: Mapping[str, torch.Tensor] | None = None,
        verify: bool = False,
    ) -> StagedState:
        """The tensors of (``pack``, ``kind``): the latest written, committed or
        not. Into the tier's staging buffers (release the result when done),
        or into ``into``'s tensors (same names, dtypes and shapes). ``verify``:
        check the checksums (opening a tier checks what it resumes)."""
        key = _key(pack, kind)
        with self._lock:
            slot, rec = self._latest(key, pack, kind)
            self._claim(key)
        try:
            return self._read(key, slot, rec, into, verify, key)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _read(
        self,
        key: str,
        slot: int,
        rec: dict,
        into: Mapping[str, torch.Tensor] | None,
        verify: bool,
        what: str,
    ) -> StagedState:
        layout = tuple(Entry.from_json(e) for e in rec["layout"])
        size = rec["nbytes"]
        give_back = None
        if into is None:
            flat = self._staging.take(size)
            tensors = {
                e.name: flat[e.offset : e.offset + e.nbytes].view(e.torch_dtype).view(e.shape)
                for e in layout
            }
            pieces = [(0, byte_view(flat))] if size else []
            give_back = functools.partial(self._staging.give, flat)
        else:
            if set(into) != {e.name for e in layout}:
                raise DiskTierError(
                    f"disk tier: {key} holds {sorted(e.name for e in layout)}; "
                    f"the tensors to read into are {sorted(into)}"
                )
            tensors = dict(into)
            pieces = segments(layout, size, into, for_read=True)
        try:
            self._load(key, slot, rec, pieces, verify, what)
        except BaseException:
            if give_back is not None:
                give_back()
            raise
        return StagedState(tensors, give_back)

    def _load(self, key: str, slot: int, rec: dict, pieces: list, verify: bool, what: str) -> None:
        """Read the payload of ``slot`` into ``pieces``, checking its checksums if
        ``verify``."""
        path = self._path(key, slot)
        try:
            fd = self.io.open(path, write=False)
            try:
                crcs = self.io.read(
                    fd, len(_header(key, rec)), pieces, rec["nbytes"], verify, rec["chunk"]
                )
            finally:
                os.close(fd)
        except OSError as err:
            raise DiskTierError(f"disk tier: cannot read {path} ({err.strerror})") from None
        if verify and [f"{c:08x}" for c in crcs] != rec["crcs"]:
            raise DiskTierError(
                f"disk tier: {path} is damaged: its checksums do not match the manifest's ({what})"
            )

    def write(self, pack: Pack, kind: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the tensors of (``pack``, ``kind``) (contiguous host tensors, by
        name) to the slot the committed state is not in, and fsync it. It
        becomes the committed state at the next :meth:`commit`."""
        key = _key(pack, kind)
        layout, size = layout_of(tensors)
        pieces = segments(layout, size, tensors, for_read=False)
        rec = {
            "layout": [e.to_json() for e in layout],
            "nbytes": size,
            "chunk": self.io.chunk,
            "crcs": ["0" * 8] * -(-size // self.io.chunk),
        }  # placeholders of the final width
        with self._lock:
            self._claim(key)
            if key in self._pending:
                slot = self._pending.pop(key)[0]
            else:
                entry = self._entries.get(key)
                slot = 0 if entry is None else 1 - entry["current"]
        path, offset = self._path(key, slot), len(_header(key, rec))
        new = not path.exists()
        try:
            fd = self.io.open(path, write=True)
            try:
                os.ftruncate(fd, offset + round_up(size, PAGE))
                rec["crcs"] = [f"{c:08x}" for c in self.io.write(fd, offset, pieces, size)]
                self.io.write_block(fd, 0, _header(key, rec))  # last: whole when it says so
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if new:  # its name survives a power cut before the manifest names it
                fsync_dir(self.directory)
        except OSError as err:
            free = shutil.disk_usage(self.directory).free
            why = err.strerror
            if no_space(err):
                why = (
                    f"no space left: it needs {format_bytes(offset + size)} and "
                    f"{format_bytes(free)} are free"
                )
            raise DiskTierError(
                f"disk tier: cannot write {path} ({why}); the committed state "
                f"of step {self.step} is intact"
            ) from None
        finally:
            with self._lock:
                self._busy.discard(key)
        with self._lock:
            self._pending[key] = (slot, rec)

    def commit(self, step: int) -> None:
        """Make the writes since the last commit the state of ``step`` (a number
        larger than the last committed one), atomically."""
        if (
            not isinstance(step, int)
            or isinstance(step, bool)
            or (self.step is not None and step <= self.step)
        ):
            raise DiskTierError(
                f"disk tier: commit(step) needs a step after {self.step}, got {step!r}"
            )
        with self._lock:
            if self._busy:
                raise DiskTierError(
                    f"disk tier: commit while {sorted(self._busy)} are being read or written"
                )
            entries = json.loads(json.dumps(self._entries))  # a copy, changed once on disk
            for key, (slot, rec) in self._pending.items():
                entry = entries.setdefault(
                    key, {"created": step, "current": slot, "slots": [None] * SLOTS}
                )
                entry["slots"][slot] = {**rec, "step": step}
                entry["current"] = slot
            manifest = {"format": FORMAT, "step": step, "entries": entries}
            write_atomic(self.directory / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
            self._entries, self._pending, self.step = entries, {}, step

    def discard(self) -> None:
        """Forget the writes since the last commit (a failed step): reads return
        the committed state again, and the next writes reuse the same slots."""
        with self._lock:
            if self._busy:
                raise DiskTierError(
                    f"disk tier: discard while {sorted(self._busy)} are being read or written"
                )
            self._pending = {}

    # ---- bookkeeping ----------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return self.io.bytes["read"]

    @property
    def bytes_written(self) -> int:
        return self.io.bytes["write"]

    def close(self) -> None:
        """Stop the I/O threads and give the tier's buffers back to the budget."""
        self.io.close()
        self._staging.close()
        if self._budget is not None and self._io_name in self._budget.allocations:
            self._budget.release(self._io_name)

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _claim(self, key: str) -> None:
        """Mark ``key`` busy (under the lock): one reader or writer at a time."""
        if key in self._busy:
            raise DiskTierError(f"disk tier: {key} is being read or written by another thread")
        self._busy.add(key)

    def _path(self, key: str, slot: int) -> Path:
        name, kind = key.split("/")
        return self.directory / f"pack-{name}.{kind}.{slot}"

    def __repr__(self) -> str:
        return (
            f"DiskTier({str(self.directory)!r}, step={self.step}, "
            f"{len(self._entries)} (pack, kind))"
        )


def _key(pack: Pack, kind: str) -> str:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise DiskTierError(f"a state kind is a lower-case name such as 'optimizer'; got {kind!r}")
    return f"{pack_name(pack)}/{kind}"


def _header(key: str, rec: dict) -> bytes:
    name, kind = key.split("/")
    return header_bytes(
        {"pack": name, "kind": kind, **{k: v for k, v in rec.items() if k != "step"}}
    )


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DiskTierError(
            f"disk tier {directory} has no committed state (no {MANIFEST}): "
            "DiskTier.create starts a run there"
        ) from None
    except (OSError, ValueError) as err:
        raise DiskTierError(f"disk tier: cannot read {path} ({err}); it is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DiskTierError(f"disk tier: {path} is not a format-{FORMAT} manifest of this harmony")
    return manifest
