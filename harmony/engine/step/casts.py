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
"""

from __future__ import annotations

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
    pairs: list[tuple[torch.Tensor, torch.Tensor]], pool: BufferPool, non_blocking: bool
) -> None:
    """Copy each ``(device destination, host source)`` of ``pairs``; a source of
    another dtype than its GPU destination is cast on the host into a page-locked
    buffer of ``pool`` first, copied from there without blocking, and the buffers
    go back to ``pool`` once the copies are complete (one wait for all)."""
    staged = []
    for dst, src in pairs:
        if dst.device.type != "cuda" or src.device.type != "cpu" or src.dtype == dst.dtype:
            dst.copy_(src, non_blocking=non_blocking)
            continue
        buffer = pool.take(src.numel(), dst.dtype)
        buffer.view(src.shape).copy_(src)
        dst.copy_(buffer.view(src.shape), non_blocking=True)
        staged.append((buffer, dst.device))
    for device in {d for _, d in staged}:
        torch.cuda.current_stream(device).synchronize()
    for buffer, _ in staged:
        pool.give(buffer)
