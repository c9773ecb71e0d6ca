"""A model whose first and last packs are 16x the others (GPT-2's embedding and
LM head): the disk tier stages each big pack beside its two neighbours, the
gradient slots hold it beside one, and what the engine really holds is what
the placement charged for them (less than copies of the largest pack), while
training stays bitwise the run in memory."""

from __future__ import annotations

import pytest
import torch
from test_disk_tier_engine import FAST_DISK, adamw, state_alone
from torch import nn

from harmony import EmulatedDevice, Engine, Plan
from harmony.engine.disk_setup import load_staging
from harmony.engine.tiers.files import ALIGN
from harmony.policies.disk_tier import windowed_gradients
from harmony.policies.state import host_state

D, H, B = 128, 1024, 8
SMALL = 6
#: the big packs' parameters (two Linears: weights and biases), padded in the tier's files
PADDING = 3 * ALIGN * 4
BACKWARD = ((0, 3),) + tuple((i, i + 1) for i in range(3, 3 + SMALL)) + ((9, 12),)
PLAN = Plan("harmony-pp", 1, B, 2, 2, BACKWARD[:-1], BACKWARD)
# weights 2.5 MB, AdamW state 5 MB; optimizer state on disk, and the weights too
BUDGETS = {"optimizer": "7MB", "weights": "6MB"}


@pytest.fixture(autouse=True)
def budgets_for_the_state_alone(monkeypatch):
    state_alone(monkeypatch.setattr)  # see tests/test_disk_tier_engine.py


def make_model() -> nn.Sequential:
    torch.manual_seed(0)

    def big() -> list[nn.Module]:
        return [nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)]

    return nn.Sequential(*big(), *[nn.Linear(D, D) for _ in range(SMALL)], *big())


def train(host: str | None, tier=None) -> Engine:
    device = EmulatedDevice("8MB", "1GB/s", "1GB/s")
    e = Engine(
        make_model(),
        adamw,
        nn.functional.mse_loss,
        device=device,
        minibatch_size=B,
        plan=PLAN,
        hardware=device.hardware(),
        host_memory=host,
        safe_updates=False,
        **({} if tier is None else dict(disk_dir=tier, disk=FAST_DISK)),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        e.step(torch.randn(B, D, generator=g), torch.randn(B, D, generator=g))
    return e


@pytest.fixture(scope="module")
def in_memory():
    e = train(None)
    try:
        yield e.model_state_dict()
    finally:
        e.close()


@pytest.mark.parametrize("kind", list(BUDGETS))
def test_what_the_engine_holds_is_what_was_charged(tmp_path, kind, in_memory):
    e = train(BUDGETS[kind], tmp_path / "tier")
    try:
        placement, spec = e.disk.placement, e.spec
        assert {k for _, k in placement.on_disk} == {"optimizer", kind}
        assert len(placement.on_disk) == len(BACKWARD) * (1 + (kind == "weights"))
        state = [host_state(spec, range(*p)) for p in BACKWARD]
        staged = [s.optimizer + s.weights * (kind == "weights") for s in state]
        # a big pack staged beside its two neighbours, not three big packs
        assert placement.staging_bytes == staged[0] + 2 * staged[1] < 2 * staged[0]
        slots = e.disk.update_slots  # what the staging buffers took at most: the same
        assert placement.staging_bytes <= slots.peak <= placement.staging_bytes + PADDING
        # a big pack's gradients beside one neighbour's
        gradients = e.gradient_slots
        expected = state[0].gradients + state[1].gradients
        assert gradients.allocated_bytes == gradients.nbytes == expected
        assert windowed_gradients(spec, PLAN) == expected < 2 * state[0].gradients
        if kind == "weights":  # two neighbouring loads' reads per GPU, as set aside
            loads = e.disk.load_slots
            assert 0 < loads.peak <= load_staging(e._graph_cache, 2, PADDING)
        assert e.host_settings.budget.peak <= e.host_settings.budget.capacity
        for name, value in e.model_state_dict().items():
            assert torch.equal(value, in_memory[name]), name
    finally:
        e.close()
