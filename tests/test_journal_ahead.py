"""The update journal's copies made during the forward (``UpdateJournal(ahead=True)``,
a GPU's): the same training, bit for bit, as copies made at each update, and a
failed step undone from them."""

from __future__ import annotations

import threading

import pytest
import torch
from poisoned import Poison, Scale
from torch import nn

from harmony import EmulatedDevice, Engine, FlatAdamW, NonFiniteError, Plan
from harmony.engine.journal import UpdateJournal
from harmony.engine.step import journal_ahead as ahead_module
from harmony.engine.step import updates as updates_module

B = 12


def engine(ahead: bool, optimizer=None, **kw) -> Engine:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.Tanh(), Scale(16), nn.Linear(16, 16), nn.Tanh()]
    m = nn.Sequential(*layers, nn.Linear(16, 5))
    packs = tuple((i, i + 1) for i in range(len(m)))
    e = Engine(
        m,
        optimizer or (lambda ps: FlatAdamW(ps, lr=1e-2)),
        nn.functional.cross_entropy,
        device=EmulatedDevice(memory=int(64e6), h2d="4GB/s", d2h="4GB/s"),
        minibatch_size=B,
        plan=Plan("harmony-pp", 1, B, 4, 4, packs[:-1], packs),
        **kw,
    )
    assert e.journal.ahead is False  # an emulated GPU: off unless asked
    e.journal.ahead = ahead
    return e


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)) for _ in range(n)
    ]


def snapshot(e: Engine) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in e.model.parameters()]
    for opt in filter(None, e.optimizers.values()):
        for s in opt.state.values():
            state += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return state


def equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def ahead_first(monkeypatch):
    """Every pack copied ahead before any update begins (as on a GPU whose forward
    outlasts the copies); the copies made ahead and those the updates took, counted."""
    done, counts = threading.Event(), {"ahead": 0, "taken": 0}
    run, update = ahead_module.JournalAhead._run, updates_module.Updates.update
    record_ahead, record = UpdateJournal.record_ahead, UpdateJournal.record

    def whole_run(self):
        claimed, self.updates.claimed = self.updates.claimed, set()  # as if none had begun
        try:
            run(self)
        finally:
            self.updates.claimed = claimed
            done.set()

    def waiting_update(self, task):
        done.wait(10)
        update(self, task)

    def counted_ahead(self, key, opt):
        record_ahead(self, key, opt)
        counts["ahead"] += key in self._ahead

    def counted_record(self, key, opt, *a, **kw):
        counts["taken"] += key in self._ahead
        record(self, key, opt, *a, **kw)

    monkeypatch.setattr(ahead_module.JournalAhead, "_run", whole_run)
    monkeypatch.setattr(updates_module.Updates, "update", waiting_update)
    monkeypatch.setattr(UpdateJournal, "record_ahead", counted_ahead)
    monkeypatch.setattr(UpdateJournal, "record", counted_record)
    return done, counts


@pytest.mark.parametrize(
    "optimizer", [None, lambda ps: torch.optim.AdamW(ps, lr=1e-2)], ids=["flat", "torch"]
)
def test_copies_made_ahead_train_bitwise_as_copies_made_at_each_update(optimizer):
    a, b = engine(True, optimizer), engine(False, optimizer)
    plain = engine(False, optimizer, safe_updates=False)
    for x, y in batches(4):
        for e in (a, b, plain):
            e.step(x, y)
    assert equal(snapshot(a), snapshot(b))
    assert equal(snapshot(a), snapshot(plain))


def test_a_failed_step_is_undone_from_the_copies_made_ahead(ahead_first):
    done, counts = ahead_first
    e = engine(True)
    (x0, y0), (x1, y1) = batches(2)
    e.step(x0, y0)  # the first step creates the state: nothing to copy ahead yet
    before = snapshot(e)
    done.clear()
    Poison.on = True  # layer 2's gradient is NaN: found after the later packs' updates
    try:
        with pytest.raises(NonFiniteError, match="gradient of layers 2..2"):
            e.step(x1, y1)
    finally:
        Poison.on = False
    assert counts["ahead"] >= 3 and counts["taken"] >= 1  # undone from copies made ahead
    assert equal(snapshot(e), before)
    assert e.step_count == 1
    done.clear()
    e.step(x1, y1)  # and the run goes on
    assert e.step_count == 2
