"""KARMA, HYDRA, ZeRO-Offload and GPipe-with-swapping as policies: in the
simulator (closed-form bytes, no deadlock, plans that fit) and in the engine
(within the device's memory, measured bytes, training like the plain loop)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hardwares, model_specs, scenarios, simple_hardware, tiny_spec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_engine import ADAMW, SGD_MOMENTUM, B, batches, loss_fn, make_model, reference, train

import harmony
from harmony import (
    EmulatedDevice,
    EmulatedServer,
    HarmonyError,
    LayerCost,
    ModelSpec,
    OutOfMemoryError,
    Plan,
)
from harmony.graph import BWD, FWD, P2P, REC, REDUCE, UPD, W_IN
from harmony.planner import karma, systems
from harmony.planner.packing import bwd_pack_bytes, fwd_pack_bytes
from harmony.policies import gpipe_swap, hydra
from harmony.policies.common import microbatches, replica_shares
from harmony.simulate import play

NEW = ("karma", "hydra", "zero-offload", "gpipe-swap")
CHOOSERS = {
    "karma": lambda spec, hw, mb, n: systems.choose_karma(spec, hw, mb, max(1, mb // (2 * n)), n),
    "hydra": lambda spec, hw, mb, n: systems.choose_hydra(spec, hw, mb),
    "zero-offload": lambda spec, hw, mb, n: systems.choose_zero_offload(spec, hw, mb, n_gpus=n),
    "gpipe-swap": lambda spec, hw, mb, n: systems.choose_gpipe_swap(
        spec, hw, mb, n_gpus=min(n, len(spec))
    ),
}
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- simulator -------------------------------------------------------------------------
@PROPS
@given(scenarios(policies=NEW))
def test_graphs_play_without_deadlock_and_move_the_closed_form_bytes(case):
    spec, hw, plan = case
    graph = harmony.build_graph(spec, hw, plan)
    graph.check()  # every dependency comes first: playing cannot deadlock
    start, end, _, _ = play(graph)
    assert all(math.isfinite(x) for x in start + end)
    simulated, closed = graph.bytes_by_kind(), harmony.swap_volume(spec, plan)
    for kind in set(simulated) | set(closed):
        assert math.isclose(
            simulated.get(kind, 0.0), closed.get(kind, 0.0), rel_tol=1e-9, abs_tol=1e-6
        ), (kind, plan.describe())


@st.composite
def chooser_cases(draw):
    spec = draw(model_specs(max_layers=8))
    need = max(bwd_pack_bytes(spec, i, i + 1, 1) for i in range(len(spec)))
    hw = draw(
        hardwares(max_gpus=3, memory=st.floats(1.5, 30.0).map(lambda f: max(1, int(need * f))))
    )
    n = draw(st.integers(1, hw.n_gpus))
    return spec, hw, n * draw(st.integers(1, 4)), n, draw(st.sampled_from(NEW))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chooser_cases())
def test_each_plan_chooser_returns_a_plan_of_its_policy_that_fits(case):
    spec, hw, minibatch, n, policy = case
    try:
        plan = CHOOSERS[policy](spec, hw, minibatch, n)
    except OutOfMemoryError as err:
        assert f"no {policy} plan for" in str(err)
        assume(False)
    assert plan.policy == policy and plan.minibatch == minibatch
    s = harmony.simulate(spec, hw, plan).summary
    assert s.fits and all(peak <= hw.gpu_memory for peak in s.peak_memory.values())


def test_policies_are_registered_everywhere():
    assert set(NEW) <= set(harmony.POLICIES)
    assert set(NEW) <= set(harmony.policies.POLICIES)
    hw = simple_hardware(2, memory=40_000_000)
    assert harmony.plan_for("karma", tiny_spec(4), hw, 8).policy == "karma"
    with pytest.raises(HarmonyError, match="for karma use harmony.planner.plan_for"):
        harmony.search(tiny_spec(4), simple_hardware(2), 8, policies=["karma"])


# ---- KARMA's performance model ------------------------------------------------------------
def _chain(inputs: list[float], params: int = 250_000) -> ModelSpec:
    """Identical layers but for the size of their inputs."""

    def layer(i):
        return LayerCost(
            f"l{i}",
            param_numel=params,
            input_numel_per_sample=inputs[i],
            fwd_time=harmony.Curve.linear(1e-3),
            bwd_time=harmony.Curve.linear(3e-3),
        )

    return ModelSpec("chain", tuple(layer(i) for i in range(len(inputs))))


def test_karma_swaps_only_what_memory_forces_it_to():
    spec = _chain([1e3, 5e4, 1e3, 5e4, 5e4, 5e4])
    hw = simple_hardware(1, link=1e8)
    # room for every layer in one pack: nothing is swapped, everything is recomputed
    assert karma.model_packs(spec, hw, 4, 1, 1e12) == ((0, 6),)
    # room for four layers: one swap, of the small input of layer 2, and the largest fused pack
    budget = bwd_pack_bytes(spec, 2, 6, 4) * 1.01
    assert bwd_pack_bytes(spec, 1, 6, 4) > budget
    assert karma.model_packs(spec, hw, 4, 1, budget) == ((0, 2), (2, 6))
    assert karma.model_packs(spec, hw, 4, 1, 1.0) is None  # not even one layer fits


def _packings(L: int):
    for cuts in range(1 << (L - 1)):
        bounds = [0] + [i for i in range(1, L) if cuts >> (i - 1) & 1] + [L]
        yield tuple(zip(bounds[:-1], bounds[1:]))


@settings(max_examples=25, deadline=None)
@given(model_specs(max_layers=7), hardwares(max_gpus=2), st.integers(1, 8), st.floats(0.05, 1.0))
def test_karma_model_packs_are_the_cheapest_packing_that_fits(spec, hw, u, fraction):
    total = sum(bwd_pack_bytes(spec, i, i + 1, u) for i in range(len(spec)))
    budget = fraction * total

    def cost(packs):
        if not all(bwd_pack_bytes(spec, a, b, u) <= budget for a, b in packs) or not all(
            fwd_pack_bytes(spec, a, b, u) <= budget for a, b in packs[:-1]
        ):
            return math.inf
        return sum(
            karma.pack_seconds(spec, hw, u, hw.n_gpus, a, b, i == len(packs) - 1)
            for i, (a, b) in enumerate(packs)
        )

    best = min(cost(p) for p in _packings(len(spec)))
    chosen = karma.model_packs(spec, hw, u, hw.n_gpus, budget)
    if best == math.inf:
        assert chosen is None
    else:
        assert math.isclose(cost(chosen), best, rel_tol=1e-9)


def test_karma_plans_its_own_model_packs_at_the_largest_microbatch_that_fits():
    spec, hw = (
        _chain([1e3, 5e5, 1e3, 5e5, 5e5, 5e5]),
        simple_hardware(2, link=1e8, memory=30_000_000),
    )
    plan = systems.choose_karma(spec, hw, 16, 4, n_gpus=2)
    assert (plan.fwd_microbatch, plan.bwd_microbatch, plan.n_gpus) == (4, 4, 2)
    assert plan.fwd_packs == plan.bwd_packs[:-1]
    # KARMA's model, not a search, decides where to swap
    assert plan.bwd_packs == karma.model_packs(spec, hw, 4, 2, 0.5 * hw.gpu_memory)
    assert harmony.simulate(spec, hw, plan).summary.fits

    # without a microbatch: the largest that fits (of the 8 samples per GPU)
    def fits(u: int) -> bool:
        try:
            return systems.choose_karma(spec, hw, 16, u, n_gpus=2) is not None
        except OutOfMemoryError:
            return False

    largest = max(u for u in (1, 2, 4, 8) if fits(u))
    assert systems.choose_karma(spec, hw, 16, n_gpus=2).bwd_microbatch == largest


# ---- graph shapes ----------------------------------------------------------------------------
def test_hydra_spills_between_shards_on_one_gpu_and_carries_the_model_index():
    spec, hw = tiny_spec(6), simple_hardware(2)
    plan = Plan("hydra", 1, 8, 4, 4, ((0, 2), (2, 4)), ((0, 2), (2, 4), (4, 6)))
    graph = hydra.build(spec, hw, plan, model=3)
    assert {t.model for t in graph.tasks} == {3} and {t.device for t in graph.tasks} <= {
        "gpu0",
        "cpu",
    }
    kinds = graph.bytes_by_kind()
    assert kinds["ACT_OUT"] == kinds["ACT_IN"] > 0 and kinds.get(P2P, 0.0) == 0
    # double buffering: a shard's weights load once for all microbatches, while the previous one
    # computes
    assert kinds[W_IN] == spec.weight_bytes(0, 4) + spec.weight_bytes()


def test_gpipe_swap_runs_stages_in_gpipe_order():
    spec, hw = tiny_spec(6), simple_hardware(2)
    plan = Plan("gpipe-swap", 2, 8, 2, 2, ((0, 1), (1, 2), (2, 4)), ((0, 2), (2, 4), (4, 6)))
    assert gpipe_swap.stages(plan) == [0, 0, 1]
    tl = harmony.simulate(spec, hw, plan).timeline
    gpu0 = tl[tl.lane == "gpu0.compute"].sort_values("start_s")
    # 4 microbatches x 3 packs forward, then 2 backward (recompute, then backward)
    assert list(gpu0.kind) == [FWD] * 12 + [REC, BWD] * 8
    # forward packs on the stage of their first layer
    assert set(tl[tl.kind == FWD].device) == {"gpu0"}
    # every pack's weights cross once per microbatch, forward and backward
    assert (tl.kind == W_IN).sum() == 4 * (3 + 3)
    # one stage boundary, both ways
    assert tl[tl.kind == P2P].bytes.sum() == 2 * spec.input_bytes(4, 8)


def test_zero_offload_exchanges_gradients_after_every_microbatch_and_shards_the_update():
    spec, hw = tiny_spec(4), simple_hardware(2)
    plan = Plan("zero-offload", 2, 8, 2, 2, ((0, 2),), ((0, 2), (2, 4)))
    graph = harmony.build_graph(spec, hw, plan)
    reduces = [t for t in graph.tasks if t.kind == REDUCE]
    assert len(reduces) == 2 * 2 * 2  # per pack, per microbatch step, per GPU
    updates = [t for t in graph.tasks if t.kind == UPD]
    assert sorted(t.data.shard for t in updates) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert {t.lane for t in updates} == {"cpu0", "cpu1"}


@pytest.mark.parametrize(
    "plan, message",
    [
        (Plan("hydra", 2, 8, 4, 4, (), ((0, 4),)), "hydra spills one model on one GPU"),
        (
            Plan("zero-offload", 2, 5, 2, 2, (), ((0, 4),)),
            r"same number of microbatches.*\[2, 1\] microbatches",
        ),
        (Plan("zero-offload", 4, 2, 1, 1, (), ((0, 4),)), r"\[1, 1, 0, 0\] microbatches"),
        (Plan("gpipe-swap", 2, 8, 2, 2, (), ((0, 4),)), "1 backward packs cannot fill 2 stages"),
        (
            Plan("karma", 1, 8, 4, 2, (), ((0, 4),)),
            r"fwd_microbatch \(4\) must equal bwd_microbatch \(2\)",
        ),
        (
            Plan("gpipe-swap", 1, 8, 4, 2, (), ((0, 4),)),
            "gpipe-swap runs each microbatch forward then backward",
        ),
    ],
)
def test_bad_plans_are_refused_with_what_to_do(plan, message):
    spec, hw = tiny_spec(4), simple_hardware(4)
    for call in (
        lambda: harmony.build_graph(spec, hw, plan),
        lambda: harmony.swap_volume(spec, plan),
    ):
        with pytest.raises(HarmonyError, match=message):
            call()


def test_plan_choosers_refuse_what_their_system_cannot_do():
    with pytest.raises(HarmonyError, match="minibatch divisible by its 2 GPUs"):
        systems.choose_zero_offload(tiny_spec(4), simple_hardware(2), 7)
    with pytest.raises(OutOfMemoryError, match="no hydra plan for tiny fits in the 1 KB"):
        systems.choose_hydra(tiny_spec(4), simple_hardware(1, memory=1000), 8)


# ---- engine ------------------------------------------------------------------------------------
FWD3, BWD3 = ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9))
DEVICE = EmulatedDevice(memory="4MB", h2d="400MB/s", d2h="400MB/s")


def server(n: int) -> EmulatedServer:
    return EmulatedServer(gpus=n, memory="4MB", h2d="400MB/s", d2h="400MB/s", p2p="400MB/s")


@pytest.mark.parametrize(
    "policy, n, device, fwd, bwd",
    [
        ("karma", 1, DEVICE, ((0, 4),), ((0, 4), (4, 9))),
        ("hydra", 1, DEVICE, FWD3, BWD3),
        ("zero-offload", 1, DEVICE, FWD3, BWD3),
        # stage 0 holds two packs (BatchNorm in the first), stage 1 the fused one
        ("gpipe-swap", 2, server(2), FWD3, BWD3),
    ],
)
def test_exact_on_one_device_or_pipeline_bitwise_like_the_plain_loop(policy, n, device, fwd, bwd):
    data = batches(3)
    expected, ref_losses = reference(SGD_MOMENTUM, data, microbatch=4)  # dropout, BatchNorm
    engine, losses = train(Plan(policy, n, B, 4, 4, fwd, bwd), SGD_MOMENTUM, data, device)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.buffers(), expected.buffers()))
    assert losses == ref_losses
    assert all(0 < peak <= 4e6 for peak in engine.trace.summary.peak_memory.values())


@pytest.mark.parametrize("policy", ["karma", "zero-offload"])
def test_data_parallel_is_allclose_to_the_plain_loop_on_the_same_microbatches(policy):
    n, data = 2, batches(3)
    split = [m for share in replica_shares(B, n) for m in microbatches(share, 2)]
    model = make_model(0.0, batchnorm=False)
    opt = ADAMW(list(model.parameters()))
    ref_losses = [
        harmony.reference_step(list(model), loss_fn, opt, (x,), y, None, step, microbatches=split)
        for step, (x, y) in enumerate(data)
    ]
    engine, losses = train(
        Plan(policy, n, B, 2, 2, FWD3, BWD3), ADAMW, data, server(n), dropout=0.0, batchnorm=False
    )
    for a, b in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    shards = n if policy == "zero-offload" else 1  # ZeRO partitions the update over the GPUs
    assert len(engine.optimizers) == len(BWD3) * shards


@pytest.mark.parametrize(
    "policy, n", [("karma", 2), ("hydra", 1), ("zero-offload", 2), ("gpipe-swap", 2)]
)
def test_measured_bytes_equal_the_closed_form_within_capacity(policy, n):
    plan = Plan(policy, n, B, 2, 2, FWD3, BWD3, {"offload_activations": policy == "gpipe-swap"})
    engine, _ = train(
        plan, ADAMW, batches(1), server(n) if n > 1 else DEVICE, dropout=0.0, batchnorm=False
    )
    s = engine.trace.summary
    for kind, volume in harmony.swap_volume(engine.spec, engine.plan).items():
        assert s.bytes_by_kind.get(kind, 0.0) == pytest.approx(volume, rel=1e-9), kind
    assert all(peak <= 4e6 for peak in s.peak_memory.values())


def test_an_engine_given_a_bad_plan_says_so_before_anything_runs():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = harmony.Engine(
        model,
        ADAMW,
        loss_fn,
        device=server(5),
        minibatch_size=B,
        plan=Plan("zero-offload", 5, B, 2, 2, FWD3, BWD3),  # 3, 3, 2, 2, 2 samples
    )
    with pytest.raises(HarmonyError, match="same number of microbatches"):
        engine.step(*batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
