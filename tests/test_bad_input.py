"""Every public entry point refuses bad input with harmony's own error, saying
what was wrong and what to do, before any state changes."""

from __future__ import annotations

import pytest
import torch
from test_engine import ADAMW, B, loss_fn, make_model
from torch import nn

import harmony
from harmony import (
    CheckpointDir,
    CheckpointError,
    EmulatedDevice,
    EmulatedServer,
    Engine,
    Hardware,
    HarmonyError,
    Plan,
    decompose,
    model_spec,
    parse_bytes,
    parse_rate,
    preset,
    search,
    simulate,
    swap_volume,
)
from harmony.cli import main as cli

PLAN = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
GPT2_XL = model_spec("gpt2-xl")
PAPER = preset("paper-4x1080ti")


def engine(**changes):
    kwargs = dict(
        model=make_model(), optimizer=ADAMW, loss_fn=loss_fn, minibatch_size=B, plan=PLAN
    )
    kwargs.update(changes)
    return Engine(**kwargs)


def packs(*bwd, fwd=()):
    return engine(plan=Plan("harmony-pp", 1, B, 4, 4, fwd, bwd))


def hardware(**changes):
    kwargs = dict(
        name="x",
        n_gpus=1,
        gpu_memory=10**9,
        gpu_flops=1e12,
        h2d=1e9,
        d2h=1e9,
        uplink=1e9,
        gpus_per_switch=1,
        p2p=None,
        cpu_update_bandwidth=1e9,
        cpu_update_workers=1,
        host_memory=10**10,
    )
    kwargs.update(changes)
    return Hardware(**kwargs)


class Branchy(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


CONSTRUCTION = {  # id: (call, message)
    "size with an unknown unit": (lambda: parse_bytes("12XB"), "cannot read size '12XB'"),
    "size that is not text": (lambda: parse_bytes(None), "cannot read size None"),
    "negative bandwidth": (lambda: parse_rate("-5GB/s"), "cannot read bandwidth"),
    "emulated memory junk": (lambda: EmulatedDevice(memory="abc"), "emulated device memory"),
    "emulated negative link": (lambda: EmulatedDevice(h2d="-1MB/s"), "emulated h2d bandwidth"),
    "emulated server without GPUs": (lambda: EmulatedServer(gpus=0), "gpus >= 1"),
    "emulated server bad switch": (
        lambda: EmulatedServer(gpus=2, gpus_per_switch=3),
        "gpus_per_switch",
    ),
    "hardware without GPUs": (lambda: hardware(n_gpus=0), "n_gpus"),
    "hardware negative bandwidth": (lambda: hardware(h2d=-1.0), "h2d"),
    "unknown preset": (lambda: preset("dgx-9000"), "known presets"),
    "unknown model": (lambda: model_spec("gpt5"), "known models"),
    "search minibatch 0": (
        lambda: search(GPT2_XL, PAPER, 0),
        "minibatch size must be a positive integer",
    ),
    "search unknown policy": (
        lambda: search(GPT2_XL, PAPER, 16, policies=["magic"]),
        "known policies",
    ),
    "search more GPUs than the server": (
        lambda: search(GPT2_XL, PAPER, 16, n_gpus=9),
        "outside 1..4",
    ),
    "simulate a plan for another model": (
        lambda: simulate(GPT2_XL, PAPER, PLAN),
        "must cover layers 0..51",
    ),
    "swap volume of a plan for another model": (
        lambda: swap_volume(GPT2_XL, PLAN),
        "must cover layers 0..51",
    ),
    "plan JSON that is not JSON": (lambda: Plan.from_json("{policy"), "not valid JSON"),
    "plan option that does not exist": (
        lambda: Plan("harmony-pp", 1, 4, 4, 4, (), ((0, 2),), {"turbo": 1}),
        "unknown plan option",
    ),
    "overlapping packs": (lambda: packs((0, 5), (4, 9)), "overlaps the previous pack"),
    "packs with a gap": (lambda: packs((0, 4), (5, 9)), "leaves layers 4..4 uncovered"),
    "packs not covering every layer": (lambda: packs((0, 5)), "must cover layers 0..8"),
    "empty pack": (lambda: packs((0, 0), (0, 9)), "empty or reversed"),
    "forward packs past the fused pack": (
        lambda: packs((0, 3), (3, 9), fwd=((0, 5),)),
        "fwd_packs must cover",
    ),
    "microbatch larger than the minibatch": (
        lambda: engine(plan=Plan("harmony-pp", 1, B, 24, 24, (), ((0, 9),))),
        "larger than the minibatch",
    ),
    "different microbatches with BatchNorm": (
        lambda: engine(plan=Plan("harmony-pp", 1, B, 4, 6, ((0, 3),), ((0, 3), (3, 9)))),
        "must be equal",
    ),
    "plan for more GPUs than the engine has": (
        lambda: engine(plan=Plan("harmony-pp", 2, B, 4, 4, (), ((0, 9),))),
        "plan is for 2 GPUs",
    ),
    "plan for another minibatch": (
        lambda: engine(plan=Plan("harmony-pp", 1, 8, 4, 4, (), ((0, 9),))),
        "plan is for minibatch 8",
    ),
    "plan given as a dict": (
        lambda: engine(plan={"policy": "harmony-pp"}),
        "plan must be a harmony.Plan",
    ),
    "unknown device": (lambda: engine(device="tpu"), "unknown device 'tpu'"),
    "minibatch size 0": (
        lambda: engine(minibatch_size=0),
        "minibatch_size must be a positive integer",
    ),
    "optimizer factory returning nothing": (
        lambda: engine(optimizer=lambda ps: None),
        "not a torch.optim",
    ),
    "optimizer instead of a factory": (
        lambda: engine(optimizer=torch.optim.SGD(make_model().parameters(), lr=1.0)),
        "must be a factory",
    ),
    "loss function that is not callable": (
        lambda: engine(loss_fn="mse"),
        "loss_fn must be callable",
    ),
    "unknown non-finite policy": (lambda: engine(nonfinite="ignore"), "nonfinite must be one of"),
    "negative seed": (lambda: engine(seed=-1), "seed must be a non-negative integer"),
    "model that is not a module": (
        lambda: decompose(object()),
        "cannot split a object into layers",
    ),
    "model with data-dependent control flow": (
        lambda: decompose(Branchy()),
        "cannot split Branchy",
    ),
    "empty model": (lambda: decompose(nn.Sequential()), "at least one layer"),
    "checkpoint that does not exist": (
        lambda: Engine.load("no-such.ckpt", make_model(), ADAMW, loss_fn),
        "no-such.ckpt does not exist",
    ),
    "keep no checkpoints": (lambda: CheckpointDir("run", keep=0), "keep must be a positive"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION))
def test_bad_settings_get_a_clear_error(case):
    call, message = CONSTRUCTION[case]
    with pytest.raises(HarmonyError, match=message):
        call()


X = torch.randn(B, 16)
Y = torch.zeros(B, dtype=torch.long)
STEPS = {  # id: (inputs, target, message)
    "too few samples": (
        torch.randn(5, 16),
        torch.zeros(5, dtype=torch.long),
        "expected a minibatch of 12",
    ),
    "inputs of the wrong width": (
        torch.randn(B, 7),
        Y,
        r"cannot run on the given inputs \(\(12, 7\)",
    ),
    "inputs of the wrong dtype": (torch.zeros(B, 16, dtype=torch.long), Y, "torch.int64"),
    "target that is a list": (X, [0] * B, "takes torch tensors"),
    "inputs that are numpy": (X.numpy(), Y, "takes torch tensors"),
}


class TupleOut(nn.Module):
    def forward(self, x):
        return x, x


LOSSES = {  # id: (model change, loss, target, message)
    "target of the wrong dtype": (None, loss_fn, torch.randn(B), "expected target dtype|Long"),
    "target of the wrong shape": (None, loss_fn, torch.zeros(B, 3, dtype=torch.long), "target"),
    "last layer returning a tuple": (
        TupleOut(),
        loss_fn,
        Y,
        "returns a tuple, whose elements are passed",
    ),
    "loss without reduction": (
        None,
        lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"),
        Y,
        r"not a scalar \(reduction='none'\?\)",
    ),
    "loss as a Python float": (
        None,
        lambda o, t: float(nn.functional.cross_entropy(o, t)),
        Y,
        "returned a float, not a tensor",
    ),
    "loss detached from the output": (
        None,
        lambda o, t: nn.functional.cross_entropy(o.detach(), t),
        Y,
        "does not depend on the model's output",
    ),
}


@pytest.mark.parametrize("case", list(LOSSES))
def test_a_loss_that_cannot_train_is_refused_before_anything_runs(case):
    extra, loss, target, message = LOSSES[case]
    model = make_model()
    if extra is not None:
        model.append(extra)
    n = len(model)
    e = Engine(
        model,
        ADAMW,
        loss,
        minibatch_size=B,
        plan=Plan("harmony-pp", 1, B, 4, 4, ((0, 3),), ((0, 3), (3, n))),
    )
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(HarmonyError, match=message):
        e.step(X, target)
    assert (
        all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
        and e.step_count == 0
    )


def test_a_model_whose_buffers_are_on_the_meta_device_is_refused():
    """Its parameters the engine can make (harmony.empty_weights); its buffers'
    values (a causal mask) are lost on the meta device."""
    with pytest.raises(
        HarmonyError,
        match=r"causal_bias is a buffer on the meta device.*"
        r"Build the model under harmony.empty_weights\(\)",
    ):
        Engine(
            nn.Sequential(*harmony.zoo.build("gpt2-tiny")[:-1]), ADAMW, loss_fn, minibatch_size=B
        )


def test_an_optimizer_over_other_parameters_is_refused():
    model = make_model()
    with pytest.raises(HarmonyError, match="build it over the parameters passed in"):
        Engine(
            model,
            lambda ps: torch.optim.AdamW(model.parameters()),
            loss_fn,
            minibatch_size=B,
            plan=PLAN,
        )


@pytest.mark.parametrize("case", list(STEPS))
def test_bad_minibatches_are_refused_before_anything_runs(case):
    inputs, target, message = STEPS[case]
    e = engine()
    before = [t.clone() for t in e.model.state_dict().values()]
    with pytest.raises(HarmonyError, match=message):
        e.step(inputs, target)
    assert all(torch.equal(a, b) for a, b in zip(before, e.model.state_dict().values()))
    assert e.step_count == 0
    e.step(X, Y)  # and the engine still works


def test_a_minibatch_unlike_the_first_is_refused():
    e = engine()
    e.step(X, Y)
    with pytest.raises(HarmonyError, match="set up for"):
        e.step(X.double(), Y)
    assert e.step_count == 1


def test_a_checkpoint_of_something_else_is_refused(tmp_path):
    from harmony.engine.checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path / "other.ckpt", {"weights": torch.ones(2)})
    with pytest.raises(CheckpointError, match="not of an engine's state"):
        Engine.load(path, make_model(), ADAMW, loss_fn)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--checkpoint-every", "2"], "needs a checkpoint directory"),
        (["train", "--resume"], "needs a checkpoint directory"),
        (["train", "--memory", "12XB"], "cannot read emulated device memory '12XB'"),
        (["train", "--plan", "missing-plan.json"], "missing-plan.json"),
        (["train", "--set", "n_layer=abc"], "n_layer must be an integer >= 1, got 'abc'"),
        (["train", "--set", "n_layer=-1"], "n_layer must be an integer >= 1, got -1"),
        (["train", "--set", "dropout=1.5"], "dropout must be in [0, 1), got 1.5"),
        (["train", "--set", "hidden=65"], "hidden 65 is not a multiple of heads 4"),
        (["train", "--set", "turbo=1"], "gpt2-tiny has no setting turbo"),
        (["train", "--model", "vgg-tiny", "--set", "widths=[8,16]"], "need the same length"),
    ],
)
def test_cli_train_errors_are_one_line(capsys, argv, message):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_table_is_big_enough():
    assert len(CONSTRUCTION) + len(STEPS) + len(LOSSES) >= 36
    assert all(
        issubclass(e, HarmonyError)
        for e in (
            CheckpointError,
            harmony.OutOfMemoryError,
            harmony.NonFiniteError,
            harmony.DeadlockError,
        )
    )
