"""Checkpoints survive crashes and resume bitwise; faults never cost state."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from test_engine import ADAMW, SGD_MOMENTUM, B, batches, loss_fn, make_model
from torch import nn

from harmony import (
    CheckpointDir,
    CheckpointError,
    EmulatedDevice,
    Engine,
    FlatAdamW,
    HarmonyError,
    NonFiniteError,
    Plan,
)
from harmony.engine import host_memory
from harmony.engine.checkpoint import read_checkpoint, write_checkpoint

PLAN = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
OTHER_PLAN = Plan("harmony-pp", 1, B, 4, 4, ((0, 2), (2, 5)), ((0, 1), (1, 4), (4, 5), (5, 9)))
EMULATED = EmulatedDevice(memory="4MB", h2d="400MB/s", d2h="400MB/s")


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def uninterrupted(optimizer, data, plan=PLAN):
    engine = Engine(make_model(), optimizer, loss_fn, minibatch_size=B, plan=plan)
    for x, y in data:
        engine.step(x, y)
    return weights(engine.model)


@pytest.mark.parametrize(
    "optimizer",
    [ADAMW, SGD_MOMENTUM, lambda ps: FlatAdamW(ps, lr=1e-2)],
    ids=["adamw", "sgd-momentum", "flat-adamw"],
)
@pytest.mark.parametrize("resume_plan", [PLAN, OTHER_PLAN], ids=["same-plan", "other-plan"])
def test_save_and_load_resume_bitwise(tmp_path, optimizer, resume_plan):
    data = batches(5)
    engine = Engine(
        make_model(), optimizer, loss_fn, device=EMULATED, minibatch_size=B, plan=PLAN, seed=3
    )
    for x, y in data[:2]:
        engine.step(x, y)
    path = engine.save(tmp_path / "run.ckpt")

    fresh = make_model()
    with torch.no_grad():  # other weights than the saved ones: load must overwrite them
        for p in fresh.parameters():
            p.add_(1.0)
    resumed = Engine.load(path, fresh, optimizer, loss_fn, device=EMULATED, plan=resume_plan)
    assert resumed.step_count == 2 and resumed.seed == 3 and resumed.plan == resume_plan
    for x, y in data[2:]:
        resumed.step(x, y)

    whole = Engine(make_model(), optimizer, loss_fn, minibatch_size=B, plan=PLAN, seed=3)
    for x, y in data:
        whole.step(x, y)
    assert same(weights(resumed.model), weights(whole.model))


def test_a_plan_change_keeps_the_optimizer_state():
    data = batches(4)
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    for step, (x, y) in enumerate(data):
        if step == 2:
            engine.set_plan(OTHER_PLAN)
        engine.step(x, y)
    assert same(weights(engine.model), uninterrupted(ADAMW, data))


def test_state_dict_round_trip_in_memory():
    data = batches(3)
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    engine.step(*data[0])
    state = engine.state_dict()
    other = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    other.load_state_dict(state)
    for x, y in data[1:]:
        other.step(x, y)
    assert same(weights(other.model), uninterrupted(ADAMW, data))


def test_a_state_for_another_model_or_run_is_refused_before_anything_changes(tmp_path):
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    engine.step(*batches(1)[0])
    path = engine.save(tmp_path / "a.ckpt")
    small = nn.Sequential(nn.Linear(16, 5))
    with pytest.raises(HarmonyError, match="for another model"):
        Engine.load(path, small, ADAMW, loss_fn)
    target = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN, seed=1)
    before = weights(target.model)
    with pytest.raises(HarmonyError, match="seed=0"):
        target.load_state_dict(read_checkpoint(path))
    assert same(before, weights(target.model)) and target.step_count == 0


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif how == "flipped":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    elif how == "header":
        path.write_bytes(data[:30])
    else:
        path.write_bytes(b"PK\x03\x04 not ours")


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "truncated"),
        ("flipped", "checksum"),
        ("header", "truncated|header"),
        ("foreign", "not a harmony checkpoint"),
    ],
)
def test_a_damaged_checkpoint_is_rejected_naming_the_file_and_the_previous_one_resumes(
    tmp_path, how, message
):
    data = batches(3)
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    run = CheckpointDir(tmp_path / "run", keep=2)
    for x, y in data[:2]:
        engine.step(x, y)
        run.save(engine.state_dict(), engine.step_count)
    newest = run.paths()[-1]
    _damage(newest, how)
    with pytest.raises(
        CheckpointError, match=f"{newest.name}.*({message})|({message}).*{newest.name}"
    ):
        read_checkpoint(newest)
    logged = []
    path, state = run.latest(logged.append)
    assert path.name == "step-00000001.ckpt" and state["step"] == 1
    assert newest.name in logged[0] and newest.exists()  # reported, left for inspection


def test_checkpoint_dir_keeps_the_last_k_and_writes_atomically(tmp_path, monkeypatch):
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    run = CheckpointDir(tmp_path, keep=2)
    for step in range(4):
        run.save(engine.state_dict(), step)
    assert [p.name for p in run.paths()] == ["step-00000002.ckpt", "step-00000003.ckpt"]

    def crash(*args, **kwargs):  # the disk fills up in the middle of the write
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        run.save(engine.state_dict(), 4)
    monkeypatch.undo()
    assert [p.name for p in run.paths()] == ["step-00000002.ckpt", "step-00000003.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002.ckpt",
        "step-00000003.ckpt",
    ]
    read_checkpoint(run.paths()[-1])


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(CheckpointError, match="is a directory"):
        write_checkpoint(tmp_path, {})
    with pytest.raises(CheckpointError, match="keep must be a positive"):
        CheckpointDir(tmp_path, keep=0)


# ---- faults during a step -------------------------------------------------------------
class Poison(nn.Module):
    """Identity, until told to produce ``value`` (a NaN or infinity) in step ``at``."""

    def __init__(self):
        super().__init__()
        self.value, self.where = None, "output"

    def forward(self, x):
        if self.value is None:
            return x
        if self.where == "output":
            return x * self.value
        return PoisonGrad.apply(x, self.value)


class PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.value, None


def poisoned_model():
    model = make_model()
    return nn.Sequential(*model[:4], Poison(), *model[4:])


NAN_PLAN = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 7)), ((0, 3), (3, 7), (7, 10)))


@pytest.mark.parametrize("where", ["output", "gradient"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_loss_or_gradient_stops_before_any_weight_changes(where, value):
    data = batches(2)
    model = poisoned_model()
    engine = Engine(model, ADAMW, loss_fn, minibatch_size=B, plan=NAN_PLAN)
    engine.step(*data[0])
    before = weights(model)
    states = [
        opt.state_dict()["state"][0]["exp_avg"].clone() for opt in engine.optimizers.values()
    ]
    model[4].value, model[4].where = value, where
    with pytest.raises(NonFiniteError, match="loss of samples|gradient of layers"):
        engine.step(*data[1])
    assert same(before, weights(model))
    assert all(
        torch.equal(opt.state_dict()["state"][0]["exp_avg"], s)
        for opt, s in zip(engine.optimizers.values(), states)
    )
    assert engine.step_count == 1 and all(p.grad is None for p in model.parameters())


def test_skip_policy_skips_the_bad_step_and_goes_on():
    data = batches(3)
    model = poisoned_model()
    engine = Engine(model, ADAMW, loss_fn, minibatch_size=B, plan=NAN_PLAN, nonfinite="skip")
    engine.step(*data[0])
    before = weights(model)
    model[4].value, model[4].where = float("nan"), "gradient"
    with pytest.warns(UserWarning, match="step 1 skipped"):
        loss = engine.step(*data[1])
    assert loss != loss and same(before, weights(model))
    assert engine.step_count == 2 and engine.skipped_steps == 1
    model[4].value = None
    assert torch.isfinite(torch.tensor(engine.step(*data[2])))  # trains again
    assert not same(before, weights(model)) and engine.step_count == 3


def test_not_enough_host_memory_is_said_before_the_first_step(monkeypatch):
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1000)
    before = weights(engine.model)
    with pytest.raises(
        HarmonyError, match=r"host memory: this plan needs .* KB more host memory \(gradients"
    ):
        engine.step(*batches(1)[0])
    assert same(before, weights(engine.model)) and engine.step_count == 0
    monkeypatch.undo()
    engine.step(*batches(1)[0])


def test_host_memory_estimate_counts_gradients_optimizer_state_and_stash():
    engine = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    engine.step(*batches(1)[0])  # plan, spec and optimizer state now exist
    fresh = Engine(make_model(), ADAMW, loss_fn, minibatch_size=B, plan=PLAN)
    fresh.spec = engine.spec
    need = host_memory.host_bytes_needed(fresh.kept_on_host(), engine._graph_cache)
    weight_bytes = sum(p.numel() * 4 for p in fresh.model.parameters())
    assert need["gradients"] == weight_bytes and need["optimizer state"] == 2 * weight_bytes
    # layer 0: the minibatch itself; 6: fused
    assert need["stashed inputs"] == engine.spec.input_bytes(3, B)
    ran = host_memory.host_bytes_needed(engine.kept_on_host(), engine._graph_cache)
    assert ran["optimizer state"] == 0  # allocated
    assert ran["emulated GPU memory"] == 0  # cpu backend


def test_an_emulated_gpu_counts_its_memory_as_host_memory():
    engine = Engine(make_model(), ADAMW, loss_fn, device=EMULATED, minibatch_size=B, plan=PLAN)
    engine.step(*batches(1)[0])
    need = host_memory.host_bytes_needed(engine.kept_on_host(), engine._graph_cache)[
        "emulated GPU memory"
    ]
    # its copies and computations: as much as its peak, and a slack
    peak = engine.trace.summary.peak_memory["gpu0"]
    assert need == int(peak * (1 + host_memory.EMULATED_SLACK)) > 0
    with pytest.raises(HarmonyError, match="emulated GPU memory"):
        host_memory.check_host_memory(
            engine.kept_on_host(), engine._graph_cache, available=int(need)
        )


# ---- a run killed with SIGKILL, resumed ---------------------------------------------------
@pytest.mark.heavy
def test_a_run_killed_at_random_moments_resumes_to_bitwise_the_same_weights(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from reliability import kill_and_resume

    result = kill_and_resume(tmp_path, kills=3, seed=7)
    assert result["kills"] == 3 and result["bitwise_equal"]


def test_huge_but_finite_gradients_are_not_mistaken_for_non_finite_ones():
    from harmony.engine.journal import check_finite_gradients

    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.full((4,), 3e38)  # its sum overflows float32
    check_finite_gradients(opt, (0, 1))
    p.grad[2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"shape \(4,\) holds NaN"):
        check_finite_gradients(opt, (0, 1))


def test_page_locking_weights_without_the_host_memory_for_it_is_refused(monkeypatch):
    from harmony.engine.buffers import HostLayout
    from harmony.engine.tiers import system

    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(system, "available_host_bytes", lambda: 100)
    # checked before pinning
    with pytest.raises(HarmonyError, match="page-locked weights need it on CUDA"):
        HostLayout(list(model), pin=True)
    # without a GPU: left as they are
    with pytest.warns(UserWarning, match="copied tensor by tensor"):
        HostLayout(list(model), pin=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _journaled_adamw(params):
    """An AdamW whose updates are all journaled: a step hook (code of the caller's) keeps
    the step short of its point of no return (harmony.engine.optim_ready)."""
    opt = ADAMW(params)
    opt.register_step_pre_hook(lambda *_: None)
    return opt


def test_the_rollback_journal_reuses_its_buffers_from_step_to_step():
    engine = Engine(make_model(), _journaled_adamw, loss_fn, minibatch_size=B, plan=PLAN)
    data = batches(3)
    engine.step(*data[0])  # creates the optimizer state (journaled whole)
    engine.step(*data[1])
    first = {key: [t.data_ptr() for t in ts] for key, ts in engine.journal._buffers.items()}
    engine.step(*data[2])
    assert (
        first
        and {key: [t.data_ptr() for t in ts] for key, ts in engine.journal._buffers.items()}
        == first
    )
    # every update but the step's last task
    assert len(engine.journal.entries) == len(engine.optimizers) - 1
