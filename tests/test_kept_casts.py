"""A weight load's cast kept for the pack's next load in the same step
(``StepContext.keep_casts``, on for a GPU where no host budget is set): the same
bits as casting at every load, one cast per pack per step, nothing kept from one
step to the next, every kept buffer back in its pool when the step ends."""

from __future__ import annotations

import pytest
import torch

from harmony import EmulatedDevice, Engine, Plan
from harmony.engine.buffers import BufferPool
from harmony.engine.step.casts import KeptCasts, stage
from harmony.workbench.training import build_model, lm_loss, synthetic_batch

NAME, B, STEPS = "gpt2-tiny", 8, 3


def run(keep: bool, precision: str, casts: list | None = None) -> Engine:
    model = build_model(NAME, 0)
    n = len(model)
    plan = Plan("harmony-pp", 1, B, 4, 4, ((0, 2), (2, n - 1)), ((0, 2), (2, n - 1), (n - 1, n)))
    engine = Engine(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lm_loss,
        device=EmulatedDevice(memory="8MB", h2d="1GB/s", d2h="1GB/s"),
        minibatch_size=B,
        plan=plan,
        precision=precision,
    )
    assert engine.keep_casts is False  # an emulated GPU: off unless asked
    engine.keep_casts = keep
    for step in range(STEPS):
        engine.step(*synthetic_batch(NAME, B, step))
        if casts is not None:
            casts.append(engine.host.pool.allocations)
    return engine


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_kept_casts_train_bitwise_as_casting_at_every_load(precision):
    kept, cast = run(True, precision), run(False, precision)
    for a, b in zip(kept.model.parameters(), cast.model.parameters()):
        assert torch.equal(a, b)


def test_the_kept_casts_go_back_to_the_pool_and_are_reused_the_next_step(monkeypatch):
    calls, made = [], []
    inner = KeptCasts.cast

    def counted(self, src, dtype):
        calls.append(1)
        before = len(self.casts)
        out = inner(self, src, dtype)
        made.extend([1] * (len(self.casts) - before))
        return out

    monkeypatch.setattr(KeptCasts, "cast", counted)
    allocations: list = []
    run(True, "bf16", allocations)
    # the packs loaded twice in a step (forward and backward) were cast once
    assert 0 < len(made) < len(calls)
    # the first step fills the pool; the later ones take the same buffers back
    assert allocations[1] == allocations[0] == allocations[2]


def test_a_pack_loaded_twice_in_a_step_is_cast_once():
    pool = BufferPool(torch.device("cpu"))
    kept = KeptCasts(pool)
    master = torch.randn(64)
    made = []
    for _ in range(2):
        dst = torch.empty(64, dtype=torch.bfloat16)
        stage([(dst, master)], pool, non_blocking=False, kept=kept)
        made.append(pool.allocations)
        assert torch.equal(dst, master.to(torch.bfloat16))
    assert made[0] == made[1]  # the second load took no new buffer: it used the kept cast
    assert len(kept.casts) == 1
    kept.close()
    assert not kept.casts
    # closed: the next step's cast is made anew (the weights may have changed since)
    master.add_(1)
    dst = torch.empty(64, dtype=torch.bfloat16)
    stage([(dst, master)], pool, non_blocking=False, kept=kept)
    assert torch.equal(dst, master.to(torch.bfloat16))
