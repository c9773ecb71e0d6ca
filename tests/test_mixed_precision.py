"""Mixed precision: half the bytes on every link, training close to a plain
``torch.autocast`` loop, master weights and optimizer state in float32."""

from __future__ import annotations

import pytest
import torch

from harmony import (
    EmulatedDevice,
    Engine,
    HarmonyError,
    Plan,
    reference_step,
    simulate,
    swap_volume,
)
from harmony.workbench.training import build_model, lm_loss, synthetic_batch

NAME, B, STEPS = "gpt2-tiny", 8, 3
SGD = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731  (Adam's sign-like steps hide small differences)
DEVICE = EmulatedDevice(memory="8MB", h2d="1GB/s", d2h="1GB/s")


def n_layers() -> int:
    return len(build_model(NAME))


def plan() -> Plan:
    n = n_layers()
    return Plan("harmony-pp", 1, B, 4, 4, ((0, 2), (2, n - 1)), ((0, 2), (2, n - 1), (n - 1, n)))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def engine_run(precision: str):
    model = build_model(NAME, 0)
    engine = Engine(
        model, SGD, lm_loss, device=DEVICE, minibatch_size=B, plan=plan(), precision=precision
    )
    for step in range(STEPS):
        engine.step(*synthetic_batch(NAME, B, step))
    return engine


def reference_run(dtype):
    model = build_model(NAME, 0)
    opt = SGD(model.parameters())
    for step in range(STEPS):
        x, y = synthetic_batch(NAME, B, step)
        reference_step(list(model), lm_loss, opt, x, y, 4, step, autocast=dtype)
    return model


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_training_is_close_to_a_plain_autocast_loop(precision, dtype):
    engine = engine_run(precision)
    ours, theirs = flat(engine.model), flat(reference_run(dtype))
    update = (theirs - flat(build_model(NAME, 0))).norm()
    # within 2% of the update's size (the float32 loop is ~0.1-0.6% away from the autocast one)
    assert (ours - theirs).norm() / update < 0.02
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    assert all(
        s["momentum_buffer"] is None or s["momentum_buffer"].dtype == torch.float32
        for opt in engine.optimizers.values()
        for s in opt.state.values()
    )


def test_links_carry_half_the_bytes_and_the_closed_form_knows_it():
    fp32, bf16 = engine_run("fp32"), engine_run("bf16")
    moved32, moved16 = fp32.trace.summary.bytes_by_kind, bf16.trace.summary.bytes_by_kind
    for kind in ("W_IN", "G_OUT", "STASH_OUT"):  # STASH_IN also brings back the token ids (int64)
        assert moved16.get(kind, 0) * 2 == moved32.get(kind, 0), kind
    assert bf16.spec.param_dtype == bf16.spec.act_dtype == "bfloat16"
    closed = swap_volume(bf16.spec, bf16.plan)
    assert {k: v for k, v in moved16.items() if v} == {k: v for k, v in closed.items() if v}
    simulated = simulate(bf16.spec, bf16.hardware(), bf16.plan).summary.bytes_by_kind
    assert {k: v for k, v in simulated.items() if v} == {k: v for k, v in closed.items() if v}


def test_fp16_overflow_skips_the_step_and_halves_the_loss_scale():
    model = build_model(NAME, 0)
    engine = Engine(
        model, SGD, lm_loss, device=DEVICE, minibatch_size=B, plan=plan(), precision="fp16"
    )
    engine.step(*synthetic_batch(NAME, B, 0))
    assert engine.loss_scale == 2.0**16
    before = flat(model)
    engine.loss_scale = 2.0**60  # float16 gradients overflow
    assert engine.step(*synthetic_batch(NAME, B, 1)) != engine.step_count  # nan
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0**59
    assert torch.equal(before, flat(model))
    engine.loss_scale = 2.0**10
    engine.step(*synthetic_batch(NAME, B, 2))
    assert not torch.equal(before, flat(model)) and engine.skipped_steps == 1


def test_a_checkpoint_keeps_precision_and_loss_scale(tmp_path):
    engine = engine_run("fp16")
    engine.loss_scale = 1024.0
    path = engine.save(tmp_path / "fp16.ckpt")
    resumed = Engine.load(path, build_model(NAME, 0), SGD, lm_loss, device=DEVICE)
    assert resumed.precision == "fp16" and resumed.loss_scale == 1024.0
    with pytest.raises(HarmonyError, match="precision='fp16'"):
        Engine.load(path, build_model(NAME, 0), SGD, lm_loss, device=DEVICE, precision="bf16")


def test_unknown_precision_is_refused():
    with pytest.raises(HarmonyError, match="precision must be one of"):
        Engine(build_model(NAME, 0), SGD, lm_loss, minibatch_size=B, plan=plan(), precision="fp8")


def batchnorm_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 5),
    )


def batchnorm_runs(norm_dtype_kept: bool = True):
    """One step (every forward with the same weights as the plain loop's)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(B, 16, generator=g) * 3 + 1, torch.randint(0, 5, (B,), generator=g))]
    loss = torch.nn.functional.cross_entropy
    engine = Engine(
        batchnorm_model(),
        SGD,
        loss,
        device=DEVICE,
        minibatch_size=B,
        precision="bf16",
        plan=Plan("harmony-pp", 1, B, 2, 2, ((0, 3),), ((0, 3), (3, 7))),
    )
    if not norm_dtype_kept:
        engine.norm_tensors = [set() for _ in engine.layers]  # every float tensor in bf16
    reference = batchnorm_model()
    opt = SGD(reference.parameters())
    for step, (x, y) in enumerate(data):
        engine.step(x, y)
        reference_step(list(reference), loss, opt, (x,), y, 2, step, autocast=torch.bfloat16)
    return engine, reference


def test_batchnorm_keeps_float32_statistics_under_mixed_precision():
    engine, reference = batchnorm_runs()
    for (name, ours), theirs in zip(engine.model.named_buffers(), reference.buffers()):
        assert torch.equal(ours, theirs), (
            name
        )  # running statistics as autocast keeps them, not rounded to bf16
    bf16 = batchnorm_runs(norm_dtype_kept=False)[0]
    worst = max(
        ((a - b).abs() / b.abs().clamp_min(1e-3)).max()
        for a, b in zip(bf16.model.buffers(), reference.buffers())
        if a.is_floating_point()
    )
    assert worst > 1e-3  # statistics that travel in bf16 are rounded: the test can tell
    # the closed form counts BatchNorm's tensors in float32 and its batch counter
    closed = swap_volume(engine.spec, engine.plan)
    moved = engine.trace.summary.bytes_by_kind
    assert {k: v for k, v in moved.items() if v} == {k: v for k, v in closed.items() if v}
