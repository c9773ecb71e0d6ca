"""Meters of the device memory a compute task holds beyond its graph buffers.

The task graph gives every compute task a *working memory* buffer (what its
spec says the task holds besides weights, inputs and outputs). The engine
measures what the task really holds, the way :mod:`harmony.engine.describe`
measured it for the spec: intermediate outputs of a forward pass without
autograd, and the tensors autograd saves during recompute. A
:class:`WorkMeter` charges the device ledger only for what goes beyond the
declared working memory, so a spec that counts right costs nothing and one
that undercounts shows as a larger measured peak, never as silence.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..costs.hardware import format_bytes


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the tensors autograd saves, once per storage. Storages
    of ``exclude`` (the task's weights and the buffers it reads: held, and
    declared, elsewhere) and leaves that require grad are not counted; a view of
    a tensor counts its whole storage, which it keeps alive. ``charge`` is
    called with each new storage's bytes."""

    def __init__(
        self, charge: Callable[[int], None] | None = None, exclude: Iterable[torch.Tensor] = ()
    ):
        self.seen: set = {storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
        self.total = 0

        def pack(t: torch.Tensor):  # called for every tensor autograd saves: kept lean
            if not (t.requires_grad and t.is_leaf):
                storage = t.untyped_storage()
                key = (storage.data_ptr(), t.dtype)
                if key not in self.seen:
                    n = storage.nbytes()
                    if charge is not None:
                        charge(n)
                    self.seen.add(key)
                    self.total += n
            # not ``t`` itself: a tensor saved by its own grad_fn would then hold that node,
            # which holds it, a cycle only a backward breaks (a forward alone leaks its graph)
            return t.detach()

        super().__init__(pack, lambda t: t)


def storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.dtype)


class WorkMeter:
    """What a compute task holds beyond its graph buffers, against what the graph
    declared for it (its working-memory buffer): ``charge``/``release`` follow
    the real bytes; the ledger is charged only for the part above ``declared``,
    given back at :meth:`close`, which also tells the ledger how much of the
    declared bytes the task never held. ``peak`` is the most the task held."""

    def __init__(self, ledger, declared: float, what: str):
        self.ledger, self.declared, self.what = ledger, declared, what
        self.held = 0.0
        self.peak = 0.0
        self.excess = 0.0  # charged to the ledger beyond the declared bytes

    def charge(self, nbytes: float) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        self.ledger.note_held(nbytes)
        over = self.held - self.declared
        if over > self.excess:
            self.ledger.charge(
                over - self.excess,
                f"{self.what}, beyond the {format_bytes(self.declared)} of "
                "working memory its spec declared",
                declared=False,
            )
            self.excess = over

    def release(self, nbytes: float) -> None:
        self.held -= nbytes
        self.ledger.note_held(-nbytes)

    def close(self) -> None:
        self.ledger.note_unheld_work(self.declared - self.peak)
        self.ledger.note_held(-self.held)
        self.held = 0.0
        if self.excess:
            self.ledger.release(self.excess, declared=False)
            self.excess = 0.0


class Unmetered:
    """The :class:`WorkMeter` of a device that does not measure what tasks hold
    (``Backend.meters_work`` False): every call does nothing."""

    def charge(self, nbytes: float) -> None:
        pass

    def release(self, nbytes: float) -> None:
        pass

    def close(self) -> None:
        pass
