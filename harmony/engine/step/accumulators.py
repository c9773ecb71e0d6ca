"""Gradient sums kept on the GPUs (a plan's ``gpu_gradients``), as the swapping
baselines keep them (:mod:`harmony.policies.swapping`).

Each backward group (a pack on one microbatch) adds its microbatch to the
pack's accumulator on its GPU. Between two groups of a pack on one GPU the
accumulator is swapped out to host memory (a G_OUT) and back in (a G_IN),
into a slot of that GPU's own: each GPU sums its own microbatches, so the
slot is not the parameter's ``.grad``. After each GPU's last group, a ring
all-reduce (one REDUCE per GPU) leaves every GPU that ran the pack with the
sum of their accumulators, formed in GPU order, and each GPU's last G_OUT
writes that sum (the same on every GPU) to the parameters' ``.grad``.
"""

from __future__ import annotations

import threading

import torch

from ...graph import G_OUT, Gradients, Task, TaskGraph


class Accumulators:
    """Owns each GPU's running gradient sums in host memory between its groups.

    Which G_OUT of each (GPU, pack) is the final one, and the buffer of its
    final accumulator; the packs whose sum is formed (see the module docstring)."""

    def __init__(self, graph: TaskGraph):
        last: dict[tuple[str, int], Task] = {}  # (GPU, pack) -> its last G_OUT
        for t in graph.tasks:
            if t.kind == G_OUT and isinstance(t.data, Gradients):
                key = (t.device, t.pack)
                if key not in last or last[key].seq < t.seq:
                    last[key] = t
        self.finals = {t.id for t in last.values()}
        #: (GPU, pack) -> the buffer of its final accumulator
        self.final_buffer = {key: t.io["src"][0] for key, t in last.items()}
        self.slots: dict[tuple[str, int], dict[tuple[int, str], torch.Tensor]] = {}
        self.reduced: set[int] = set()  # packs whose sum is formed
        self.lock = threading.Lock()

    def is_final(self, task: Task) -> bool:
        """Whether the G_OUT ``task`` sends the sum of every microbatch (else it
        swaps the running sum out, to be brought back by the next G_IN)."""
        return task.id in self.finals

    def all_reduce(self, task: Task, store: dict) -> None:
        """The REDUCE ``task`` done: its GPU's accumulator of ``task.pack`` holds the
        sum over the GPUs, in GPU order (formed once, by the pack's first REDUCE to
        run: every REDUCE starts once every GPU's last group is done)."""
        gpus = sorted(
            (int(dev[3:]), buf)
            for (dev, pack), buf in self.final_buffer.items()
            if pack == task.pack
        )
        first = store[gpus[0][1]]
        with self.lock:
            if task.pack not in self.reduced:
                for _, buf in gpus[1:]:
                    for i, leaves in store[buf].items():
                        for name, leaf in leaves.items():
                            if leaf.grad is not None:
                                _add_into(first[i][name], leaf.grad)
                self.reduced.add(task.pack)
        own = store[self.final_buffer[(task.device, task.pack)]]
        if own is first:
            return
        with torch.no_grad():
            for i, leaves in own.items():
                for name, leaf in leaves.items():
                    total = first[i][name].grad
                    if total is None:
                        continue
                    if leaf.grad is None:
                        leaf.grad = torch.empty_like(leaf)
                    leaf.grad.copy_(total)


def _add_into(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """``leaf.grad += grad`` (as ``leaf.grad + grad``: the same bits), across devices."""
    with torch.no_grad():
        if leaf.grad is None:
            leaf.grad = grad.to(leaf.device, copy=True)
        else:
            leaf.grad.add_(grad.to(leaf.grad.device))
