"""The faithful baselines: per-layer swapping (vDNN / LMS, one GPU or data
parallel), GPipe with swapping, model parallelism (HYDRA's comparison), with
training state on the GPU as such systems keep it. Bytes equal their closed
form, the engine trains them like the plain loop, their choosers follow their
stated rules, and what they cannot do is refused in words."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import hardwares, model_specs, plans, simple_hardware, tiny_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import ADAMW, SGD_MOMENTUM, B, batches, loss_fn, make_model, reference, train

import harmony
from harmony import EmulatedDevice, EmulatedServer, HarmonyError, OutOfMemoryError, Plan
from harmony.graph import BWD, FWDBWD, G_IN, OPT_IN, OPT_OUT, REDUCE, UPD, W_IN
from harmony.planner import karma, systems
from harmony.policies import POLICIES
from harmony.policies.common import microbatches, replica_shares
from harmony.simulate import play

BASELINES = ("layer-swap", "gpipe-swap", "model-parallel")
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def baseline_cases(draw):
    """(spec, hardware, plan) of a baseline, its training state anywhere."""
    spec, hw = draw(model_specs(max_layers=8)), draw(hardwares(max_gpus=3))
    policy = draw(st.sampled_from(BASELINES))
    plan = draw(plans(policy, len(spec), hw.n_gpus))
    state = {"gpu_optimizer": draw(st.booleans())}
    if policy != "model-parallel":
        state["gpu_gradients"] = draw(st.booleans())
    return spec, hw, replace(plan, options={**dict(plan.options), **state})


# ---- simulator ---------------------------------------------------------------------------------
@PROPS
@given(baseline_cases())
def test_graphs_play_and_move_exactly_their_closed_form_bytes(case):
    spec, hw, plan = case
    graph = harmony.build_graph(spec, hw, plan)
    graph.check()
    start, end, _, _ = play(graph)
    assert all(math.isfinite(x) for x in start + end)
    simulated, closed = graph.bytes_by_kind(), harmony.swap_volume(spec, plan)
    for kind in set(simulated) | set(closed):
        got, want = simulated.get(kind, 0.0), closed.get(kind, 0.0)
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6), (kind, plan.describe())


def _graph(policy: str, n: int, options: dict, minibatch: int = 8, microbatch: int = 2):
    spec, hw = tiny_spec(6), simple_hardware(n)
    bwd = ((0, 2), (2, 4), (4, 6))
    plan = Plan(policy, n, minibatch, microbatch, microbatch, bwd[:-1], bwd, options)
    return spec, plan, harmony.build_graph(spec, hw, plan), harmony.simulate(spec, hw, plan)


def test_gpu_state_is_swapped_per_microbatch_and_per_iteration_and_replica():
    on_gpu = {"gpu_optimizer": True, "gpu_gradients": True}
    spec, plan, graph, trace = _graph("layer-swap", 2, on_gpu)
    count = lambda kind: sum(1 for t in graph.tasks if t.kind == kind)  # noqa: E731
    # 2 GPUs x 2 microbatches x 3 packs: the accumulator comes back for every microbatch
    # but the first
    assert count(G_IN) == 2 * (2 - 1) * 3
    assert count(REDUCE) == 2 * 3  # a ring all-reduce per pack, one share per GPU
    assert count(OPT_IN) == count(OPT_OUT) == count(UPD) == 2 * 3  # every replica steps every pack
    updates = [t for t in graph.tasks if t.kind == UPD]
    assert {t.lane for t in updates} == {"gpu0.compute", "gpu1.compute"}
    tl = trace.timeline
    for gpu in (0, 1):  # optimizer.step() once backward is done, packs in model order
        mine = tl[tl.lane == f"gpu{gpu}.compute"]
        steps = mine[mine.kind == UPD].sort_values("start_s")
        assert steps.start_s.min() >= mine[mine.kind.isin([BWD, FWDBWD])].end_s.max() - 1e-12
        assert list(steps.pack) == [0, 1, 2]
    state_in = next(t for t in graph.tasks if t.kind == OPT_IN and t.pack == 0)
    params = spec.grad_bytes(0, 2)
    # weights, gradient and Adam's two slots
    assert state_in.nbytes == 2 * params + spec.optimizer_state_bytes(0, 2)
    # on the host (the defaults) none of it: Harmony's CPU update
    _, _, host, _ = _graph("layer-swap", 2, {})
    assert {t.lane for t in host.tasks if t.kind == UPD} <= {f"cpu{i}" for i in range(4)}
    assert not any(t.kind in (G_IN, OPT_IN, OPT_OUT, REDUCE) for t in host.tasks)


def test_a_pipeline_steps_each_pack_on_its_stage_and_model_parallel_moves_no_state():
    _, plan, graph, _ = _graph("gpipe-swap", 2, {"gpu_optimizer": True})
    stage = harmony.policies.gpipe_swap.stages(plan)
    steps = {(t.pack, t.device) for t in graph.tasks if t.kind == UPD}
    assert steps == {(q, f"gpu{stage[q]}") for q in range(3)}
    spec, plan, graph, trace = _graph("model-parallel", 2, {"gpu_optimizer": True})
    kinds = trace.summary.bytes_by_kind
    assert kinds.get(W_IN, 0.0) == kinds.get("G_OUT", 0.0) == kinds.get("STASH_OUT", 0.0) == 0.0
    assert kinds["DATA_IN"] == spec.input_bytes(0, 8) + spec.target_bytes(8)
    # one GPU busy at a time: compute tasks never overlap, whatever GPU they run on
    compute = trace.timeline[trace.timeline.lane.str.endswith("compute")].sort_values("start_s")
    assert (compute.start_s.to_numpy()[1:] >= compute.end_s.to_numpy()[:-1] - 1e-12).all()


@pytest.mark.parametrize("policy", BASELINES)
def test_an_update_on_the_gpu_streams_at_the_hardware_gpu_update_bandwidth(policy):
    spec, plan, _, _ = _graph(policy, 2, {"gpu_optimizer": True})
    hw = simple_hardware(2)
    for rate in (1e10, 4e10):
        graph = harmony.build_graph(spec, replace(hw, gpu_update_bandwidth=rate), plan)
        steps = [t for t in graph.tasks if t.kind == UPD]
        assert steps and all(t.device.startswith("gpu") for t in steps)
        for t in steps:  # weights, gradient and Adam's two slots read; weights, slots written
            streamed = spec.grad_bytes(*t.layers) * (3 + 2 * 2)
            assert t.duration == pytest.approx(streamed / rate + hw.task_overhead_s)


def test_on_demand_loading_never_overlaps_a_weight_load_with_compute():
    spec, hw = tiny_spec(6), simple_hardware(1, link=1e8)
    demand = systems.choose_layer_swap(spec, hw, 8, prefetch=False)
    assert demand.option("prefetch_packs") == 1
    tl = harmony.simulate(spec, hw, demand).timeline
    loads = tl[tl.kind == W_IN]
    compute = tl[tl.lane == "gpu0.compute"]
    for w in loads.itertuples():
        overlaps = (compute.start_s < w.end_s - 1e-12) & (compute.end_s > w.start_s + 1e-12)
        assert not overlaps.any()
    prefetched = systems.choose_layer_swap(spec, hw, 8, microbatch=demand.bwd_microbatch)
    assert harmony.simulate(spec, hw, prefetched).iteration_s < tl.end_s.max()


def test_state_options_are_refused_by_policies_that_keep_it_on_the_host():
    plan = Plan("harmony-pp", 1, 8, 2, 2, (), ((0, 4),), {"gpu_optimizer": True})
    spec, hw = tiny_spec(4), simple_hardware(1)
    for call in (
        lambda: harmony.build_graph(spec, hw, plan),
        lambda: harmony.swap_volume(spec, plan),
    ):
        with pytest.raises(HarmonyError, match="harmony-pp keeps gradient sums and the optimizer"):
            call()
    accumulating = Plan("model-parallel", 1, 8, 2, 2, (), ((0, 4),), {"gpu_gradients": True})
    with pytest.raises(HarmonyError, match="gpu_gradients apply to .*layer-swap"):
        harmony.build_graph(spec, hw, accumulating)


# ---- choosers --------------------------------------------------------------------------------
def test_the_faithful_layer_swap_plan():
    spec = tiny_spec(6)
    plan = systems.choose_layer_swap(spec, simple_hardware(2), 16)
    assert plan.n_gpus == 2 and plan.bwd_packs == tuple((i, i + 1) for i in range(6))
    assert plan.fwd_packs == plan.bwd_packs[:-1]
    assert plan.option("gpu_optimizer") and plan.option("gpu_gradients")
    assert plan.option("prefetch_packs") == 2
    segments = systems.choose_layer_swap(spec, simple_hardware(2), 16, activations="recompute")
    # checkpoints every ceil(sqrt(6)) layers, forward still one layer at a time
    assert segments.bwd_packs == ((0, 3), (3, 6)) and len(segments.fwd_packs) == 3
    with pytest.raises(HarmonyError, match="activations must be one of swap, recompute"):
        systems.choose_layer_swap(spec, simple_hardware(2), 16, activations="offload")


def test_the_loss_runs_with_the_layer_that_feeds_it():
    spec = harmony.model_spec("gpt2-xl")  # ends in CrossEntropyLoss, which has no parameters
    packs = systems.checkpoint_packs(spec, "swap")
    assert packs[-1] == (len(spec) - 2, len(spec)) and all(b - a == 1 for a, b in packs[:-1])


@pytest.mark.parametrize(
    "policy, memory", [("layer-swap", 90e6), ("gpipe-swap", 300e6), ("model-parallel", 150e6)]
)
def test_the_chosen_microbatch_is_the_largest_that_fits(policy, memory):
    spec = tiny_spec(4, act=2_000_000.0)
    hw = simple_hardware(2, memory=int(memory))
    sweep = systems.microbatch_sweep(policy, spec, hw, 16)
    assert sweep.fits.any() and not sweep.fits.all()  # memory decides, at this size
    chosen = systems.CHOOSERS[policy](spec, hw, 16)
    assert chosen.bwd_microbatch == sweep.microbatch[sweep.fits].max()
    assert sweep.loc[sweep.chosen, "microbatch"].tolist() == [chosen.bwd_microbatch]
    assert harmony.simulate(spec, hw, chosen).summary.fits


def test_model_parallel_refuses_a_model_larger_than_the_gpus_together():
    spec, hw = tiny_spec(4), simple_hardware(2, memory=30_000_000)  # 16 MB weights, x4 with state
    with pytest.raises(
        OutOfMemoryError,
        match=r"model-parallel keeps every layer's weights, "
        r"gradients and optimizer state on the GPUs, and "
        r"tiny does not fit: it needs 64 MB resident, more "
        r"than the 2 GPUs .* hold together",
    ):
        systems.choose_model_parallel(spec, hw, 8)
    # it fits once the optimizer is on the host (what the engine runs)
    assert systems.choose_model_parallel(spec, hw, 8, gpu_optimizer=False).n_gpus == 2
    with pytest.raises(OutOfMemoryError, match="fit the GPUs together, but not with activations"):
        systems.choose_model_parallel(
            tiny_spec(4, act=1e8), simple_hardware(2, memory=80_000_000), 8
        )


def test_every_system_is_left_out_of_the_full_comparison_only_when_it_cannot_fit():
    # 64 MB to keep resident, 48 MB of GPUs
    spec, hw = tiny_spec(8, params=500_000), simple_hardware(2, memory=24_000_000)
    chosen = harmony.planner.plans_for(None, spec, hw, 8, workers=1)
    # resident (the plain loop on one of the GPUs) keeps 64 MB there too
    assert set(chosen) == set(POLICIES) - {"model-parallel", "resident"}
    with pytest.raises(OutOfMemoryError, match="model-parallel"):
        harmony.planner.plans_for(["model-parallel"], spec, hw, 8)


def test_karma_swaps_some_boundaries_and_recomputes_the_rest_of_a_real_model():
    spec, hw = harmony.model_spec("bert-96"), harmony.preset("paper-4x1080ti")
    packs = karma.model_packs(spec, hw, 8, 4, 0.5 * hw.gpu_memory)
    sizes = [b - a for a, b in packs]
    assert len(packs) > 1 and max(sizes) > 1  # both swapped inputs and recomputed layers
    plan = systems.choose_karma(spec, hw, 16)
    budget = 0.5 * hw.gpu_memory
    assert plan.bwd_packs == karma.model_packs(spec, hw, plan.bwd_microbatch, 4, budget)


# ---- engine -----------------------------------------------------------------------------------
ONE = tuple((i, i + 1) for i in range(9))
DEVICE = EmulatedDevice(memory="4MB", h2d="400MB/s", d2h="400MB/s")


def server(n: int) -> EmulatedServer:
    return EmulatedServer(gpus=n, memory="4MB", h2d="400MB/s", d2h="400MB/s", p2p="400MB/s")


@pytest.mark.parametrize(
    "policy, n, fwd, bwd, options",
    [
        ("layer-swap", 1, ONE[:-1], ONE, {}),
        ("layer-swap", 1, ONE[:-1], ONE, {"prefetch_packs": 1}),  # on demand
        ("layer-swap", 1, ONE[:6], ((0, 3), (3, 6), (6, 9)), {}),  # checkpoint segments
        ("model-parallel", 1, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)), {}),
        ("model-parallel", 2, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)), {}),
        ("model-parallel", 3, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)), {}),
    ],
)
def test_the_engine_trains_bitwise_like_the_plain_loop(policy, n, fwd, bwd, options):
    data = batches(3)
    # with dropout and BatchNorm
    expected, ref_losses = reference(SGD_MOMENTUM, data, microbatch=4)
    engine, losses = train(
        Plan(policy, n, B, 4, 4, fwd, bwd, options),
        SGD_MOMENTUM,
        data,
        DEVICE if n == 1 else server(n),
    )
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.buffers(), expected.buffers()))
    assert losses == ref_losses
    s = engine.trace.summary
    for kind, volume in harmony.swap_volume(engine.spec, engine.plan).items():
        assert s.bytes_by_kind.get(kind, 0.0) == pytest.approx(volume, rel=1e-9), kind
    assert all(0 < peak <= 4e6 for peak in s.peak_memory.values())


def test_data_parallel_layer_swap_is_allclose_to_the_plain_loop():
    n, data = 2, batches(3)
    split = [m for share in replica_shares(B, n) for m in microbatches(share, 2)]
    model = make_model(0.0, batchnorm=False)
    opt = ADAMW(list(model.parameters()))
    ref_losses = [
        harmony.reference_step(list(model), loss_fn, opt, (x,), y, None, step, microbatches=split)
        for step, (x, y) in enumerate(data)
    ]
    engine, losses = train(
        Plan("layer-swap", n, B, 2, 2, ONE[:-1], ONE),
        ADAMW,
        data,
        server(n),
        dropout=0.0,
        batchnorm=False,
    )
    for a, b in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, abs=1e-6)


def test_the_baselines_are_registered_as_systems():
    for name in BASELINES:
        assert POLICIES[name].ROLE == "system" and not POLICIES[name].SEARCHED
        assert name in systems.CHOOSERS


def test_the_old_virtual_memory_name_says_what_it_was_renamed_to_and_where_the_baselines_are():
    plan = Plan("virtual-memory", 1, 8, 2, 2, (), ((0, 4),))
    for call in (
        lambda: harmony.build_graph(tiny_spec(4), simple_hardware(1), plan),
        lambda: harmony.plan_for("virtual-memory", tiny_spec(4), simple_hardware(1), 8),
    ):
        with pytest.raises(
            HarmonyError,
            match=r"'virtual-memory' was renamed 'harmony-no-grouping'.*"
            r"ablation.*'layer-swap'.*'gpipe-swap'",
        ):
            call()
    assert POLICIES["harmony-no-grouping"].ROLE == "ablation"
