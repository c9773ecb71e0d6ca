"""Gradients of parameters tied across packs, summed on the host as autograd sums them."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable

import torch

from ...graph import TaskGraph, TiedGradients
from ..host_model import HostModel


class TieSums:
    """Owns the sums of the gradients of parameters tied across packs, on the host.

    Summed the way autograd sums them in the plain loop: per microbatch, the packs' parts in
    backward order (the highest layers first, as autograd reaches them), and
    those sums over the microbatches in order, into the parameter's ``.grad``."""

    def __init__(
        self,
        host: HostModel,
        graph: TaskGraph,
        lock: threading.Lock,
        gradient_buffer: Callable[[torch.Tensor], torch.Tensor],
    ):
        """``gradient_buffer``: where a parameter's gradient lands (the step's)."""
        self.host, self.lock, self.gradient_buffer = host, lock, gradient_buffer
        self.params: dict[int, torch.Tensor] = {}
        self.packs: dict[int, set] = defaultdict(set)  # parameter -> packs that send a part
        ranges: dict[int, set] = defaultdict(set)
        for t in graph.tasks:
            if isinstance(t.data, TiedGradients):
                for _, _, p in host.split_ties(*t.data.layers):
                    self.params[id(p)] = p
                    self.packs[id(p)].add(t.data.layers[0])
                    ranges[id(p)].add(t.data.samples)
        self.ranges = {k: sorted(v) for k, v in ranges.items()}
        self.folded = {k: 0 for k in self.params}  # microbatches summed into .grad
        # (param, samples) -> pack -> part
        self.parts: dict[tuple, dict[int, torch.Tensor]] = defaultdict(dict)

    def add(
        self, pack_start: int, samples: tuple[int, int], parts: dict[int, torch.Tensor]
    ) -> None:
        with self.lock:
            for key, part in parts.items():
                self.parts[(key, samples)][pack_start] = part
                self._fold(key)

    def _fold(self, key: int) -> None:
        p, ranges = self.params[key], self.ranges[key]
        while self.folded[key] < len(ranges):
            got = self.parts.get((key, ranges[self.folded[key]]), {})
            if len(got) < len(self.packs[key]):
                return
            del self.parts[(key, ranges[self.folded[key]])]
            ordered = [got[s] for s in sorted(got, reverse=True)]
            total = ordered[0].to(p.dtype)
            for part in ordered[1:]:
                total = total + part.to(p.dtype)
            if p.grad is None:  # memory kept from step to step
                p.grad = self.gradient_buffer(p)
                p.grad.copy_(total)
            else:
                p.grad.add_(total)
            self.folded[key] += 1
