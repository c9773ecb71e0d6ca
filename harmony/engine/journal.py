"""What an update task does to a pack's optimizer, shared by the engine and the
profiler (so the planner is told what an update really costs): refuse a
non-finite gradient, journal what the step changes so a failure later in the
training step can undo it, step."""

from __future__ import annotations

import threading

import torch

from ..costs.spec import state_slots
from ..errors import NonFiniteError
from .tiers.optimizer_state import optimizer_params


def optimizer_kind(factory) -> str:
    """What the optimizers ``factory`` makes keep, as a cost model names it: one
    is made for a probe parameter and stepped once, and the state tensors of the
    parameter's size it then holds are counted (``"adamw"``: two, ``"sgd"``: none,
    ``"sgd-momentum"``: one, else ``"slots:N"``)."""
    probe = torch.nn.Parameter(torch.zeros(3))
    probe.grad = torch.ones(3)
    opt = factory([probe])
    opt.step()
    slots = sum(
        1 for v in opt.state.get(probe, {}).values() if torch.is_tensor(v) and v.shape == (3,)
    )
    for cls, name in ((torch.optim.Adagrad, "adagrad"), (torch.optim.RMSprop, "rmsprop")):
        if isinstance(opt, cls) and state_slots(name) == slots:
            return name
    return {0: "sgd", 1: "sgd-momentum", 2: "adamw", 3: "amsgrad"}.get(slots, f"slots:{slots}")


def check_finite_gradients(opt: torch.optim.Optimizer, layers: tuple[int, int]) -> None:
    """Refuse to apply a gradient with a NaN or an infinity."""
    grads = [p.grad for p in optimizer_params(opt) if p.grad is not None]
    if not grads:
        return
    # A sum is NaN or infinite whenever an element is, and is one pass over memory on
    # all of torch's threads: on a 16-core host, 93 GB/s where the 2-norm ran on one
    # thread at 12 GB/s (slower than the AdamW step it guards), isfinite().all() at
    # 4.5 and the max-norm at 9. A finite gradient whose sum overflows is told apart
    # by the exact test on that tensor alone.
    sums = torch.stack([g.sum() for g in grads])
    if torch.isfinite(sums).all():
        return
    for g, total in zip(grads, sums):
        if not torch.isfinite(total) and not torch.isfinite(g).all():
            raise NonFiniteError(
                f"the gradient of layers {layers[0]}..{layers[1] - 1} is not finite "
                f"(a tensor of shape {tuple(g.shape)} holds NaN or infinity)",
                "gradient",
            )


class UpdateJournal:
    """What the updates of one training step changed, to undo them if the step
    fails later. The copies go into buffers kept from step to step (one set per
    optimizer): copying into memory already in use is ~3x faster here than
    cloning into fresh memory, which the kernel must fault in and zero first.

    Per optimizer: its parameters and the tensors of its state are copied;
    other state entries (numbers) are kept as they are. An optimizer without
    state yet (its first step) is saved whole through ``state_dict`` instead.

    ``ahead``: the copies may be made ahead of the updates (:meth:`record_ahead`,
    during the forward, where a GPU computes and the host has time), for
    :meth:`record` to take as they are."""

    def __init__(self, ahead: bool = False):
        self.ahead = ahead
        self._buffers: dict = {}  # key -> tensors reused for that optimizer's copies
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a copy ahead is done
        self._copying: set = set()  # keys copied ahead right now
        self._ahead: dict = {}  # key -> the copies made ahead of its update, this step
        self.entries: list = []  # (key, opt, saved) in the order recorded

    def start_step(self) -> None:
        self.entries = []
        self._ahead = {}

    def record_ahead(self, key, opt: torch.optim.Optimizer) -> None:
        """Copy now all that ``opt``'s next step changes, for :meth:`record` to take
        when it comes. Within a step nothing but a pack's own update changes its
        weights and state, so the copy is what the update would have made."""
        live = _live_tensors(opt)
        if live is None or not live[0]:
            return  # a first step keeps the whole state_dict, at the update
        with self._ready:
            if key in self._ahead or key in self._copying:
                return
            self._copying.add(key)
        buffers = None
        try:
            buffers = self._buffers_for(key, live[0])
            torch._foreach_copy_(buffers, live[0])
        finally:
            with self._ready:
                self._copying.discard(key)
                if buffers is not None:
                    self._ahead[key] = buffers
                self._ready.notify_all()

    def _buffers_for(self, key, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self._buffers.get(key)
        if buffers is None or [(b.shape, b.dtype) for b in buffers] != [
            (t.shape, t.dtype) for t in tensors
        ]:
            buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            self._buffers[key] = buffers
        return buffers

    def record(
        self, key, opt: torch.optim.Optimizer, params: bool = True, state: bool = True
    ) -> None:
        """Save what ``opt``'s next step changes: its parameters and its state, less
        what ``params`` / ``state`` False leave out (state that lives in a disk
        tier, whose committed copy is the undo)."""
        with self._ready:  # a copy ahead of this update is finished first
            self._ready.wait_for(lambda: key not in self._copying)
            ahead = self._ahead.pop(key, None)
        live = _live_tensors(opt, params, state)
        if ahead is not None and params and state and live and len(ahead) == len(live[0]):
            with self._lock:
                self.entries.append((key, opt, ("copies", (None, ahead), live[1])))
            return
        if live is None:  # first step: state to be created by this update
            saved = (
                "whole",
                [p.detach().clone() for p in optimizer_params(opt)] if params else [],
                clone_state(opt.state_dict()),
            )
        else:
            tensors, scalars = live
            if not tensors and not scalars:
                return
            buffers = self._buffers_for(key, tensors)
            torch._foreach_copy_(buffers, tensors)  # one call: a pack has dozens of tensors
            # partial records keep their tensors: at undo time, the state on disk is gone
            saved = ("copies", (None if params and state else tensors, buffers), scalars)
        with self._lock:
            self.entries.append((key, opt, saved))

    def undo(self) -> None:
        """Put back what every recorded update changed, latest first."""
        with torch.no_grad():
            for _, opt, (how, a, b) in reversed(self.entries):
                if how == "whole":
                    for p, old in zip(optimizer_params(opt), a):
                        p.copy_(old)
                    opt.load_state_dict(b)
                    continue
                targets, copies = a
                live = targets if targets is not None else _live_tensors(opt)[0]
                for t, old in zip(live, copies):
                    t.copy_(old)
                for (state, name), value in b:
                    state[name] = value
        self.entries = []


def _live_tensors(opt: torch.optim.Optimizer, params: bool = True, state: bool = True):
    """(the parameters and state tensors, [(state dict, name), value] of the other
    state entries) of ``opt`` (those ``params`` and ``state`` ask for), in a fixed
    order; None if its next step creates state that is asked for (a parameter
    with a gradient and no state yet)."""
    ps = optimizer_params(opt)
    if state and any(p.grad is not None and not opt.state.get(p) for p in ps):
        return None  # this step creates state: keep the whole state_dict
    tensors, scalars = list(ps) if params else [], []
    for p in ps if state else []:
        entries = opt.state.get(p, {})
        for name in sorted(entries):
            value = entries[name]
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            else:
                scalars.append(((entries, name), value))
    return [t.detach() for t in tensors], scalars


def clone_state(state: dict) -> dict:
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clone(x) for x in v]
        return v

    return clone(state)


def apply_update(
    opt: torch.optim.Optimizer,
    layers: tuple[int, int],
    key,
    journal: UpdateJournal | None,
    on_disk: tuple[str, ...] = (),
    checked: bool = False,
) -> None:
    """Step ``opt`` (the update of ``layers``) after checking its gradients (unless
    ``checked`` already); with a ``journal``, first record what the step will
    change, to undo it, less the kinds ``on_disk`` (``"weights"``, ``"optimizer"``:
    a disk tier's)."""
    if not checked:
        check_finite_gradients(opt, layers)
    if journal is not None:
        journal.record(key, opt, "weights" not in on_disk, "optimizer" not in on_disk)
    opt.step()
