"""Copies between a GPU and host memory that change dtype on the way, done fast.

``dst.copy_(src)`` across devices with a dtype change converts on the host: a
gradient in bfloat16 on the GPU is first copied, synchronously, into a
pageable temporary on the host, then converted there by the CPU; a float32
host weight bound for a bfloat16 device buffer is converted by the CPU into
a pageable temporary that is then copied synchronously. Both keep the copy
from overlapping anything. Here:

* to the host (:func:`land`): the cast runs on the GPU (a widening, exact),
  then one non-blocking copy per run into the destination (page-locked: the
  engine's host gradient buffers are, for a GPU), and one wait for all of them;
* to the device (:func:`stage`): the cast runs on the host into a page-locked
  staging buffer (the same rounding as the GPU's, so the same bits), from which
  the copy is non-blocking; the staging buffers go back to their pool once the
  task's copies have completed, so they hold one load's weights at a time.

On a device that computes on host memory nothing changes: the copies are the
plain ``copy_`` they were, bit for bit.

:class:`KeptCasts` keeps a step's staged casts for the next load of the same
weights (see ``StepContext.keep_casts``).
"""

from __future__ import annotations

import threading

import torch

from ..buffers import BufferPool


def land(runs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(host destination, source)`` of ``runs``; sources on a GPU are
    cast there first, copied without blocking, and waited for once."""
    waits = set()
    for dst, src in runs:
        if src.device.type != "cuda":
            dst.copy_(src)
            continue
        if src.dtype != dst.dtype:
            src = src.to(dst.dtype)
        dst.copy_(src, non_blocking=True)
        waits.add(src.device)
    for device in waits:  # the copies are complete before anything reads the host buffers
        torch.cuda.current_stream(device).synchronize()


def stage(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    pool: BufferPool,
    non_blocking: bool,
    kept: KeptCasts | None = None,
) -> None:
    """Copy each ``(device destination, host source)`` of ``pairs``; a source of
    another dtype than its GPU destination is cast on the host into a page-locked
    buffer of ``pool`` first, copied from there without blocking, and the buffers
    go back to ``pool`` once the copies are complete (one wait for all). With
    ``kept``, every cast (to any device) is copied from the cast ``kept`` holds
    of that source, made first if it has none."""
    staged, waits = [], set()
    for dst, src in pairs:
        casts = src.device.type == "cpu" and src.dtype != dst.dtype
        if kept is not None and casts:
            dst.copy_(kept.cast(src, dst.dtype).view(src.shape), non_blocking=dst.is_cuda)
            if dst.is_cuda:
                waits.add(dst.device)
            continue
        if dst.device.type != "cuda" or not casts:
            dst.copy_(src, non_blocking=non_blocking)
            continue
        buffer = pool.take(src.numel(), dst.dtype)
        buffer.view(src.shape).copy_(src)
        dst.copy_(buffer.view(src.shape), non_blocking=True)
        staged.append(buffer)
        waits.add(dst.device)
    for device in waits:
        torch.cuda.current_stream(device).synchronize()
    for buffer in staged:
        pool.give(buffer)


class KeptCasts:
    """The casts of host tensors one step has staged, by source (its memory, shape,
    strides) and dtype, each in a buffer of ``pool`` until :meth:`close`."""

    def __init__(self, pool: BufferPool):
        self.pool, self.lock = pool, threading.Lock()
        self.casts: dict[tuple, torch.Tensor] = {}

    def cast(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``src`` in ``dtype``, flat: the kept cast, or one made now and kept."""
        key = (src.data_ptr(), tuple(src.shape), src.stride(), dtype)
        with self.lock:
            buffer = self.casts.get(key)
        if buffer is not None:
            return buffer
        buffer = self.pool.take(src.numel(), dtype)
        buffer.view(src.shape).copy_(src)
        with self.lock:  # two loads of one pack at once (replicas): the first cast stays
            kept = self.casts.setdefault(key, buffer)
        if kept is not buffer:
            self.pool.give(buffer)
        return kept

    def close(self) -> None:
        """The step is over: every kept cast goes back to the pool."""
        with self.lock:
            casts, self.casts = self.casts, {}
        for buffer in casts.values():
            self.pool.give(buffer)
