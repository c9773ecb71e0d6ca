"""A step's point of no return: once every task but the updates has ended and
every update left is checked (gradients finite, optimizer ready), the updates
from there on are not journaled (safe_updates copies what each update changes,
which costs as much memory traffic as the update itself), and a failure from
there on (Ctrl-C) completes the step instead of undoing it."""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from poisoned import Poison, Scale
from test_optim_ready import SURE
from torch import nn

from harmony import EmulatedDevice, Engine, NonFiniteError, Plan
from harmony.engine.step import updates as updates_module

B = 12
#: the optimizers the Ctrl-C cases step: the engine's own and torch's
CTRL_C_OPTIMIZERS = ("FlatAdamW", "AdamW")
DEVICES = {
    "cpu": lambda: "cpu",
    "emulated": lambda: EmulatedDevice(memory=int(64e6), h2d="4GB/s", d2h="4GB/s"),
}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [Scale(16)]
    for _ in range(5):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 5))


def plan(n: int) -> Plan:
    """One pack per layer: many updates, most of them after the last backward."""
    bwd = tuple((i, i + 1) for i in range(n))
    return Plan("harmony-pp", 1, B, 4, 4, bwd[:-1], bwd)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)) for _ in range(n)
    ]


def engine(device: str, optimizer: str = "FlatAdamW", **kw) -> Engine:
    """An engine on ``device`` whose packs step ``SURE[optimizer]``'s optimizers."""
    m = model()
    return Engine(
        m,
        SURE[optimizer],
        nn.functional.cross_entropy,
        device=DEVICES[device](),
        minibatch_size=B,
        plan=plan(len(m)),
        **kw,
    )


def snapshot(e: Engine) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in e.model.parameters()]
    for opt in filter(None, e.optimizers.values()):  # None: a pack without parameters
        for s in opt.state.values():
            state += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return state


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def journaled(monkeypatch):
    """(journal given?, other tasks still pending?) per update, per step."""
    calls: list[list[tuple[bool, bool]]] = []
    original = updates_module.Updates._journal

    def spy(self, update=None):
        journal = original(self, update)
        if update is not None and self.ctx.journal is not None:
            calls[-1].append((journal is not None, self.memory.tasks_left > 1))
        return journal

    monkeypatch.setattr(updates_module.Updates, "_journal", spy)
    return calls


def beside_unjournaled(
    device: str, steps: int, journaled, optimizer: str = "FlatAdamW"
) -> tuple[Engine, Engine]:
    """An engine and one without the journal (safe_updates off), ``steps`` steps each
    on the same batches, what each update journaled noted per step (``journaled``)."""
    e = engine(device, optimizer)
    plain = engine(device, optimizer, safe_updates=False)
    for x, y in batches(steps):
        journaled.append([])
        e.step(x, y)
        plain.step(x, y)
    return e, plain


def test_updates_past_the_point_of_no_return_are_not_journaled(journaled, monkeypatch):
    # updates slower than the backward, as on a GPU with a host update: they queue up
    # behind it and start once every other task has ended. Each update here waits for
    # that (a sleep instead would race the backward, which a busy machine slows)
    host_update = updates_module.Updates.host_update

    def queued(self, task, key, opt):
        give_up = time.monotonic() + 60  # not a hang should that never come
        while self.memory.others_left and time.monotonic() < give_up:
            time.sleep(0.001)
        return host_update(self, task, key, opt)

    monkeypatch.setattr(updates_module.Updates, "host_update", queued)
    e, plain = beside_unjournaled("emulated", 2, journaled)
    first, *later = journaled
    # the first step creates the optimizer state: every update but the last is journaled
    assert all(j for j, pending in first if pending)
    # later steps stop journaling before the last update, the result the same bitwise
    for step_calls in later:
        assert any(pending and not j for j, pending in step_calls), step_calls
    assert equal(snapshot(e), snapshot(plain))


@pytest.mark.parametrize("optimizer", SURE)
@pytest.mark.parametrize("device", sorted(DEVICES))
def test_a_non_finite_gradient_found_at_the_point_of_no_return_undoes_the_step(device, optimizer):
    e = engine(device, optimizer)
    (x0, y0), (x1, y1) = batches(2)
    e.step(x0, y0)
    before = snapshot(e)
    Poison.on = True  # layer 0's gradient, the last one updated, is NaN
    try:
        with pytest.raises(NonFiniteError, match="gradient of layers 0..0"):
            e.step(x1, y1)
    finally:
        Poison.on = False
    assert equal(snapshot(e), before)
    assert e.step_count == 1


def ctrl_c_case(device: str, optimizer: str) -> None:
    """Ctrl-C as the last update runs, past the point of no return: the step completes
    (it counts, its result the same as an uninterrupted one's), then the interrupt is
    raised, and Ctrl-C acts as before."""
    # Ctrl-C on, as in a script run from a terminal: this process is started by the
    # suite's worker, whose SIGINT may be ignored or blocked by then (a child inherits both)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    clean = engine(device, optimizer)
    data = batches(3)
    for x, y in data[:2]:
        clean.step(x, y)
    e = engine(device, optimizer)
    e.step(*data[0])
    last = e.optimizers[(0, 0)]  # layer 0's: updated last
    # the class's step (one set on the optimizer itself would be code of the caller's,
    # which keeps the step journaled: harmony.engine.optim_ready)
    cls = type(last)
    own, step = "step" in vars(cls), cls.step

    def interrupted(self, closure=None):
        if self is last:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the update runs
        return step(self, closure)

    cls.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            e.step(*data[1])
    finally:
        if own:
            cls.step = step
        else:
            del cls.step
    assert e.step_count == 2
    assert equal(snapshot(e), snapshot(clean))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    e.step(*data[2]), clean.step(*data[2])  # the run goes on, the same
    assert equal(snapshot(e), snapshot(clean))


#: (device, optimizer) of each Ctrl-C case
CTRL_C_CASES = [(device, opt) for device in sorted(DEVICES) for opt in CTRL_C_OPTIMIZERS]


def _report(case, cases, outcome) -> None:
    """``case`` run on each of ``cases`` in turn, in this process: what failed, or None."""
    found = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    failures = []
    for args in cases:
        try:
            case(*args)
        except BaseException:
            failures.append(f"case {args}:\n{traceback.format_exc()}")
    began = f"SIGINT's handler and the blocked signals as this process began: {found}"
    outcome.put(f"{''.join(failures)}\n({began})" if failures else None)


def test_ctrl_c_past_the_point_of_no_return_completes_the_step():
    # In a fresh process with Ctrl-C on, as a user's training script is: in the suite's
    # long-lived worker, after other tests had run, the SIGINT sometimes raised nothing
    # at all (the Python-level handler unchanged: every test leaves it as found, see
    # conftest), so what is checked here would depend on what ran before it. One process
    # runs every case in turn (each turns Ctrl-C on and leaves it as it was; starting a
    # process costs about what a case does), and the failures name their cases.
    spawn = mp.get_context("spawn")
    outcome = spawn.Queue()
    child = spawn.Process(target=_report, args=(ctrl_c_case, CTRL_C_CASES, outcome))
    child.start()
    try:
        failure = outcome.get(timeout=600)
    finally:
        child.join(timeout=60)
    assert failure is None, failure


def test_the_host_update_bench_prints_its_ratios(monkeypatch, capsys):
    bench = Path(__file__).parents[1] / "bench" / "host_update.py"
    monkeypatch.setattr(sys, "argv", [str(bench), "--elements", "2e5", "--width", "64"])
    runpy.run_path(str(bench), run_name="__main__")
    out = capsys.readouterr().out
    assert "RATIO finite check 2-norm / sum" in out
    assert "RATIO journaled update / update past the point of no return" in out


@pytest.mark.parametrize("optimizer", SURE)
def test_the_cpu_backend_updates_after_the_backward_and_journals_none(journaled, optimizer):
    # nothing overlaps there: the updates wait for the backward, as a plain loop's
    # optimizer step does, and are past the point of no return from the first one on
    e, plain = beside_unjournaled("cpu", 3, journaled, optimizer)
    first, *later = journaled
    assert any(j for j, _ in first)  # the first step makes the optimizer state
    assert later and all(calls and not any(j for j, _ in calls) for calls in later), later
    assert equal(snapshot(e), snapshot(plain))


def test_an_optimizer_not_sure_to_step_keeps_its_updates_journaled(journaled):
    # a step hook is code of the caller's, which may raise: no point of no return
    e, plain = engine("cpu", "AdamW"), engine("cpu", "AdamW", safe_updates=False)
    for k, (x, y) in enumerate(batches(2)):
        if k:
            for opt in filter(None, e.optimizers.values()):
                opt.register_step_pre_hook(lambda *_: None)
        journaled.append([])
        e.step(x, y)
        plain.step(x, y)
    pending = [j for j, pending in journaled[-1] if pending]
    assert pending and all(pending), journaled[-1]
    assert equal(snapshot(e), snapshot(plain))
