"""Harmony-PP and Harmony-DP on an emulated multi-GPU server, against the plain loop."""

from __future__ import annotations

import pytest
import torch
from test_engine import ADAMW, SGD_MOMENTUM, B, batches, loss_fn, make_model, reference, train

import harmony
from harmony import EmulatedServer, HarmonyError, Plan, reference_step
from harmony.policies.common import microbatches, replica_shares

FWD, BWD = ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9))


def server(n: int, **kw) -> EmulatedServer:
    return EmulatedServer(gpus=n, memory="4MB", h2d="400MB/s", d2h="400MB/s", p2p="400MB/s", **kw)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "fwd, bwd",
    [
        (FWD, BWD),
        (((0, 2), (2, 5)), ((0, 1), (1, 4), (4, 5), (5, 9))),
        (((0, 1), (1, 5)), ((0, 1), (1, 5), (5, 9))),  # BatchNorm off gpu0
    ],
)
def test_pipeline_over_gpus_is_bitwise_identical_to_one_device(n, fwd, bwd):
    data = batches(4)
    expected, ref_losses = reference(ADAMW, data, microbatch=4)  # with dropout and BatchNorm
    engine, losses = train(Plan("harmony-pp", n, B, 4, 4, fwd, bwd), ADAMW, data, server(n))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.buffers(), expected.buffers()))
    assert losses == ref_losses
    s = engine.trace.summary
    assert s.bytes_by_kind["P2P"] > 0  # activations and their gradients went GPU to GPU
    assert set(s.peak_memory) == {f"gpu{i}" for i in range(n)}
    assert all(0 < v <= 4e6 for v in s.peak_memory.values() if v)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer", [ADAMW, SGD_MOMENTUM], ids=["adamw", "sgd-momentum"])
def test_data_parallel_is_allclose_to_the_plain_loop_on_the_same_microbatches(n, optimizer):
    data = batches(4)
    split = [m for share in replica_shares(B, n) for m in microbatches(share, 2)]
    model = make_model(0.0, batchnorm=False)
    opt = optimizer(list(model.parameters()))
    ref_losses = [
        reference_step(list(model), loss_fn, opt, (x,), y, None, step, microbatches=split)
        for step, (x, y) in enumerate(data)
    ]
    engine, losses = train(
        Plan("harmony-dp", n, B, 2, 2, FWD, BWD),
        optimizer,
        data,
        server(n),
        dropout=0.0,
        batchnorm=False,
    )
    for a, b in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    # updates were split: one optimizer per (pack, shard), each shard on its own CPU worker
    assert len(engine.optimizers) == len(BWD) * n
    assert len({t.lane for t in engine._graph_cache.tasks if t.kind == "UPD"}) == n


@pytest.mark.parametrize("policy", ["harmony-pp", "harmony-dp"])
def test_measured_bytes_equal_the_closed_form_volume(policy):
    engine, _ = train(
        Plan(policy, 2, B, 2, 2, FWD, BWD),
        ADAMW,
        batches(1),
        server(2),
        dropout=0.0,
        batchnorm=False,
    )
    measured = engine.trace.summary.bytes_by_kind
    for kind, volume in harmony.swap_volume(engine.spec, engine.plan).items():
        assert measured.get(kind, 0.0) == pytest.approx(volume, rel=1e-9), kind


def test_a_shared_uplink_is_really_shared():
    """Two GPUs loading weights through one slow uplink take at least the time the
    uplink needs for both copies; through their own links, at least one copy's
    time each. Lower bounds only: a busy machine makes copies slower, never
    faster (the exact queueing is :func:`test_the_pacer_queues_copies_on_each_link`)."""
    plan = Plan("harmony-dp", 2, B, 12 // 2, 12 // 2, (), ((0, 9),))
    big = make_model(0.0, batchnorm=False)
    weights = sum(p.numel() * 4 for p in big.parameters())

    def w_in_time(uplink):
        engine, _ = train(
            plan,
            ADAMW,
            batches(1),
            EmulatedServer(gpus=2, memory="4MB", h2d="500KB/s", d2h="1GB/s", uplink=uplink),
            dropout=0.0,
            batchnorm=False,
        )
        tl = engine.trace.timeline
        w = tl[tl.kind == "W_IN"]
        assert w["bytes"].sum() == pytest.approx(2 * weights, rel=0.01)  # each GPU loads them
        return w.end_s.max() - w.start_s.min()

    assert w_in_time(None) >= 0.99 * weights / 5e5
    assert w_in_time("500KB/s") >= 0.99 * 2 * weights / 5e5


def test_the_pacer_queues_copies_on_each_link(monkeypatch):
    """Copies that start together on routes sharing a link end one after the
    other on it; on links of their own, together (a clock of our own: no sleeping)."""
    from harmony.engine.tiers import pacing

    monkeypatch.setattr(pacing.time, "perf_counter", lambda: 0.0)
    monkeypatch.setattr(pacing.time, "sleep", lambda s: None)
    pacer = pacing.LinkPacer({"up": 100.0, "g0": 100.0, "g1": 100.0})
    assert pacer.wait(("g0",), 100, 1e9, 0.0) == 1.0
    assert pacer.wait(("g1",), 100, 1e9, 0.0) == 1.0  # its own link: at the same time
    assert pacer.wait(("up", "g0"), 100, 1e9, 0.0) == 2.0  # after g0's first copy
    assert pacer.wait(("up", "g1"), 100, 1e9, 0.0) == 2.0  # after the uplink's first copy
    assert pacer.wait(("g1",), 100, 50.0, 5.0) == 7.0  # its own rate cap, 50 B/s


def test_plan_and_device_count_must_agree():
    with pytest.raises(HarmonyError, match="plan is for 4 GPUs but the engine has 2"):
        train(Plan("harmony-pp", 4, B, 4, 4, FWD, BWD), ADAMW, batches(1), server(2))
