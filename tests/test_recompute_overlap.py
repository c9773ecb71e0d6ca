"""Harmony's schedule as published: a backward pack's recompute (REC) runs as soon
as its weights and stashed input are on the GPU, before its output gradient
arrives, and only the backward proper (BWD) waits for the gradient; a copy
waits for room on a full GPU; the fixed cost of a task is charged per task or
per pack. In the simulator and in the engine, which play the same graph."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import hardwares, model_specs, scenarios, simple_hardware, tiny_spec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import harmony
from harmony import (
    EmulatedDevice,
    EmulatedServer,
    Engine,
    HarmonyError,
    OutOfMemoryError,
    Plan,
    build_graph,
    reference_step,
    simulate_graph,
)
from harmony.engine.step.compute import Compute
from harmony.graph import BWD, COMPUTE_KINDS, FWDBWD, P2P, REC, STASH_IN, UPD, W_IN, TaskGraph
from harmony.planner.packing import bwd_pack_bytes
from harmony.simulate import play

MS = 1e-3


def _no_overlap(plan: Plan) -> Plan:
    return replace(plan, options={**dict(plan.options), "overlap_recompute": False})


def _pairs(graph: TaskGraph):
    """(REC, BWD) of every backward op."""
    bwd = {t.seq[0]: t for t in graph.tasks if t.kind == BWD}
    return [(t, bwd[t.seq[0]]) for t in graph.tasks if t.kind == REC]


def _gradient_deps(graph: TaskGraph, rec, bwd) -> set[int]:
    """What BWD waits on beyond its REC and its weights: the output gradient."""
    return {d for d in bwd.deps if d != rec.id and graph.tasks[d].kind != W_IN}


# ---- the graph -------------------------------------------------------------------------
def test_backward_op_is_recompute_on_weights_and_stash_then_backward_on_the_gradient():
    spec, hw = tiny_spec(6), simple_hardware(2)
    plan = Plan("harmony-pp", 2, 8, 4, 2, ((0, 2), (2, 4)), ((0, 2), (2, 4), (4, 6)))
    graph = build_graph(spec, hw, plan)
    graph.check()
    pairs = _pairs(graph)
    # two backward packs besides the fused one, four microbatches
    assert len(pairs) == len([t for t in graph.tasks if t.kind == BWD]) == 2 * 4
    for rec, bwd in pairs:
        assert (rec.lane, rec.layers, rec.samples) == (bwd.lane, bwd.layers, bwd.samples)
        assert rec.seq < bwd.seq and rec.id in bwd.deps
        assert {graph.tasks[d].kind for d in rec.deps} == {W_IN, STASH_IN}
        # the gradient comes from the other GPU
        assert {graph.tasks[d].kind for d in _gradient_deps(graph, rec, bwd)} == {P2P}
        # what autograd saves: taken when REC starts, freed when BWD ends (with stash and gradient)
        saved = rec.io["work"]
        assert rec.allocs == [saved] and not rec.releases and bwd.io["saved"] == saved
        assert {saved, *rec.io["stash_in"], *bwd.io["grad_in"]} <= set(bwd.releases)
        assert "work" not in bwd.io
    assert len([t for t in graph.tasks if t.kind == FWDBWD]) == 4  # the fused pack stays one task


@pytest.mark.parametrize(
    "policy, overlaps",
    [
        ("harmony-pp", True),
        ("harmony-dp", True),
        ("harmony-no-grouping", True),
        ("karma", True),
        ("hydra", False),
        ("gpipe-swap", False),
        ("zero-offload", False),
    ],
)
def test_policies_recompute_before_the_gradient_unless_their_system_does_not(policy, overlaps):
    spec = tiny_spec(6)
    plan = Plan(
        policy, 1 if policy == "hydra" else 2, 8, 2, 2, ((0, 2), (2, 4)), ((0, 2), (2, 4), (4, 6))
    )
    graph = build_graph(spec, simple_hardware(2), plan)
    assert _pairs(graph)
    for rec, bwd in _pairs(graph):
        waits = _gradient_deps(graph, rec, bwd)
        assert waits and (waits.isdisjoint(rec.deps) if overlaps else waits <= set(rec.deps))
    ablation = build_graph(spec, simple_hardware(2), _no_overlap(plan))
    for rec, bwd in _pairs(ablation):  # the same plan without the overlap: after the gradient
        assert _gradient_deps(ablation, rec, bwd) <= set(rec.deps)


def test_overlap_is_a_plan_option():
    plan = _no_overlap(Plan.uniform("harmony-pp", 1, 8, 2, num_layers=4, layers_per_pack=1))
    assert Plan.from_json(plan.to_json()) == plan and plan.option("overlap_recompute") is False
    assert (
        Plan.uniform(
            "harmony-pp", 1, 8, 2, num_layers=4, layers_per_pack=1, overlap_recompute=True
        ).options
        == ()
    )  # the default
    with pytest.raises(HarmonyError, match="option overlap_recompute must be true or false"):
        Plan("harmony-pp", 1, 8, 2, 2, (), ((0, 1),), {"overlap_recompute": "yes"}).validate()


# ---- durations and the fixed cost per task -------------------------------------------------
def test_recompute_takes_the_forward_time_and_backward_the_rest():
    # forward 1 ms, backward with recompute 3 ms, per sample and layer
    spec, hw = tiny_spec(4), simple_hardware(1)
    plan = Plan("harmony-pp", 1, 8, 4, 4, ((0, 2),), ((0, 2), (2, 4)))
    whole = spec.bwd_time(0, 2, 4, hw.gpu_flops)
    for rec, bwd in _pairs(build_graph(spec, hw, plan)):
        assert rec.duration == pytest.approx(spec.fwd_time(0, 2, 4, hw.gpu_flops))
        assert rec.duration == pytest.approx(8 * MS)
        assert rec.duration + bwd.duration == pytest.approx(whole)
    # a forward slower than the whole backward (a measured curve may say so): REC takes it all
    slow = replace(
        spec, layers=tuple(replace(c, fwd_time=harmony.Curve.linear(5e-3)) for c in spec.layers)
    )
    for rec, bwd in _pairs(build_graph(slow, hw, plan)):
        assert rec.duration == pytest.approx(whole) and bwd.duration == 0


@pytest.mark.parametrize("per", ["task", "pack"])
def test_fixed_cost_is_charged_per_task_or_once_per_pack(per):
    spec = tiny_spec(4)
    plan = Plan("harmony-pp", 1, 8, 2, 2, ((0, 2),), ((0, 2), (2, 4)))
    plain = build_graph(spec, simple_hardware(1), plan)
    hw = replace(simple_hardware(1), task_overhead_s=0.04, overhead_per=per)
    graph = build_graph(spec, hw, plan)
    extra = {t.id: t.duration - p.duration for t, p in zip(graph.tasks, plain.tasks)}
    compute = [t for t in graph.tasks if t.kind in COMPUTE_KINDS and t.kind != UPD]
    if per == "task":
        assert all(extra[t.id] == pytest.approx(0.04) for t in compute)
    else:  # on the first compute task of each weight group (each W_IN), nothing on the others
        firsts = {
            min((t for t in compute if w.id in t.deps), key=lambda t: t.seq).id
            for w in graph.tasks
            if w.kind == W_IN
        }
        assert len(firsts) == 3  # forward pack, fused pack, backward pack
        assert all(extra[t.id] == pytest.approx(0.04 if t.id in firsts else 0.0) for t in compute)
    assert all(extra[t.id] == 0 for t in graph.tasks if t.kind == UPD)


def test_overhead_per_is_checked_and_the_paper_server_charges_per_pack():
    for name in ("paper-4x1080ti", "paper-8x1080ti"):
        hw = harmony.preset(name)
        assert (hw.task_overhead_s, hw.overhead_per) == (0.04, "pack")  # the authors' time_del
        assert hw.to_dict()["overhead_per"] == "pack"
    assert simple_hardware(1).overhead_per == "task"
    with pytest.raises(HarmonyError, match="overhead_per must be one of task, pack, got 'layer'"):
        replace(simple_hardware(1), overhead_per="layer")


# ---- the overlap in the simulator ----------------------------------------------------------
def test_recompute_runs_while_the_gradient_is_on_its_way():
    # gradients cross a slow peer link: with the overlap, a REC runs while its microbatch's
    # gradient is in flight; without, after it has landed
    spec, hw = tiny_spec(4), simple_hardware(2, p2p=2e8)
    plan = Plan("harmony-pp", 2, 8, 2, 2, ((0, 2),), ((0, 2), (2, 4)))
    runs = {}
    for overlap in (True, False):
        graph = build_graph(spec, hw, plan if overlap else _no_overlap(plan))
        start, end, _, _ = play(graph)
        early = 0
        for rec, bwd in _pairs(graph):
            arrived = max(end[d] for d in _gradient_deps(graph, rec, bwd))
            assert start[bwd.id] >= arrived
            early += start[rec.id] < arrived
        assert (early > 0) == overlap
        runs[overlap] = simulate_graph(graph).summary
    assert runs[True].iteration_s < runs[False].iteration_s
    # the same tasks, only their order in time differs
    assert runs[True].lower_bound_s == pytest.approx(runs[False].lower_bound_s)
    assert runs[True].bytes_by_kind == runs[False].bytes_by_kind


# ---- a copy waits for room -------------------------------------------------------------------
def _chain():
    spec = tiny_spec(4, params=10_000_000)
    packs = tuple((i, i + 1) for i in range(4))
    return spec, simple_hardware(1), Plan("harmony-pp", 1, 8, 4, 4, packs[:-1], packs)


def test_a_load_waits_for_room_instead_of_going_over_capacity():
    spec, hw, plan = _chain()
    free = simulate_graph(build_graph(spec, hw, plan)).summary
    capacity = int(0.9 * free.peak_memory["gpu0"])  # double buffering does not fit
    tight = simulate_graph(build_graph(spec, replace(hw, gpu_memory=capacity), plan))
    assert tight.summary.fits and tight.summary.peak_memory["gpu0"] <= capacity
    assert max(b for _, b in tight.memory["gpu0"]) <= capacity
    assert tight.iteration_s > free.iteration_s  # some loads waited for a gradient to leave


def test_a_graph_that_cannot_fit_still_plays_and_says_so():
    spec, hw, plan = _chain()
    free = simulate_graph(build_graph(spec, hw, plan)).summary.peak_memory["gpu0"]
    s = simulate_graph(build_graph(spec, replace(hw, gpu_memory=int(0.3 * free)), plan)).summary
    assert not s.fits and math.isfinite(s.iteration_s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.3, 1.5))
def test_a_graph_that_fits_without_waiting_plays_as_without_the_rule(case, fraction):
    spec, hw, plan = case
    first = play(build_graph(spec, hw, plan))
    capacity = max(1, int(max(first.peak.values()) * fraction))
    bounded = build_graph(spec, replace(hw, gpu_memory=capacity), plan)
    second = play(bounded)
    if all(p <= bounded.memory_capacity[d] for d, p in first.peak.items()):
        assert second.start == first.start and second.end == first.end
    else:  # it waited, or went over where nothing could be freed: every task still ran
        assert all(math.isfinite(x) for x in second.end)


# ---- the search returns plans whose play stays within capacity -------------------------------
@st.composite
def search_cases(draw):
    spec = draw(model_specs(max_layers=8))
    need = max(bwd_pack_bytes(spec, i, i + 1, 1) for i in range(len(spec)))
    memory = st.just(max(1, int(need * draw(st.floats(1.5, 20.0)))))
    hw = draw(hardwares(max_gpus=3, memory=memory))
    return spec, hw, draw(st.integers(1, 12)), draw(st.sampled_from(["harmony-pp", "harmony-dp"]))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(search_cases())
def test_every_plan_the_search_returns_stays_within_capacity(case):
    spec, hw, minibatch, policy = case
    try:
        found = harmony.search(spec, hw, minibatch, policies=(policy,), workers=1)
    except OutOfMemoryError:
        assume(False)
    for plan in found.plan:
        trace = harmony.simulate(spec, hw, plan)
        assert trace.summary.fits, plan.describe()
        for device, steps in trace.memory.items():
            assert max(b for _, b in steps) <= hw.gpu_memory, (plan.describe(), device)


# ---- the engine ------------------------------------------------------------------------------
B, U = 8, 2
SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
MSE = nn.functional.mse_loss


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Dropout(0.1),
        nn.Linear(32, 4),
    )


def _batch(seed: int, width: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, width, generator=g), torch.randn(B, 4, generator=g)


def _server() -> EmulatedServer:
    return EmulatedServer(gpus=2, memory="4MB", h2d="200MB/s", d2h="200MB/s", p2p="50MB/s")


def _pp_plan() -> Plan:
    return Plan.uniform("harmony-pp", 2, B, U, num_layers=9, layers_per_pack=2)


def test_engine_with_and_without_overlap_trains_bitwise_as_the_plain_loop():
    steps = [_batch(seed) for seed in (1, 2)]
    expected = _model()
    opt = SGD(list(expected.parameters()))
    ref = [reference_step(list(expected), MSE, opt, x, y, U, k) for k, (x, y) in enumerate(steps)]
    for plan in (_pp_plan(), _no_overlap(_pp_plan())):
        model = _model()
        engine = Engine(model, SGD, MSE, device=_server(), minibatch_size=B, plan=plan)
        assert [engine.step(x, y) for x, y in steps] == ref
        for (name, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
            assert torch.equal(a, b), f"{name} differs, overlap {plan.option('overlap_recompute')}"
        assert engine.trace.summary.peak_memory == engine.simulate().summary.peak_memory
        assert set(engine.trace.timeline.kind) >= {REC, BWD}


def test_a_step_failing_between_recompute_and_backward_leaves_the_devices_empty(monkeypatch):
    def fail(self, task):  # a backward that fails before it has used what its REC saved
        raise RuntimeError("injected")

    x, y = _batch(1)
    engine = Engine(_model(), SGD, MSE, device=_server(), minibatch_size=B, plan=_pp_plan())
    engine.step(x, y)
    with monkeypatch.context() as patch:
        patch.setattr(Compute, "backward", fail)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step(x, y)
    for backend in engine.backends:
        assert backend.ledger.in_use == 0 and backend.ledger.held == 0, backend.name
    engine.step(x, y)
    assert engine.trace.summary.peak_memory == engine.simulate().summary.peak_memory


def test_engine_follows_loads_that_wait_for_room():
    x, y = _batch(1, width=256)
    plan = Plan.uniform("harmony-pp", 1, B, U, num_layers=5, layers_per_pack=1)

    def wide():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)], nn.Linear(256, 4))

    roomy = EmulatedDevice(memory="1GB", h2d="1GB/s", d2h="1GB/s")
    first = Engine(
        wide(), SGD, MSE, device=roomy, minibatch_size=B, plan=plan, hardware=roomy.hardware()
    )
    first.step(x, y)
    free = first.simulate().summary.peak_memory["gpu0"]
    for fraction in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7):  # below the unbounded peak, fits by waiting
        hw = replace(roomy.hardware(), gpu_memory=int(fraction * free))
        if harmony.simulate(first.spec, hw, plan).summary.fits:
            break
    else:
        pytest.fail("no capacity below the unbounded peak fits")
    tight = EmulatedDevice(memory=hw.gpu_memory, h2d="1GB/s", d2h="1GB/s")
    model = wide()
    engine = Engine(model, SGD, MSE, device=tight, minibatch_size=B, plan=plan, hardware=hw)
    engine.step(x, y)
    s = engine.trace.summary
    assert s.peak_memory == engine.simulate().summary.peak_memory
    assert s.peak_memory["gpu0"] <= hw.gpu_memory < free and s.undeclared_bytes["gpu0"] == 0
    # waiting changes when, not what: the same weights as with room to spare
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), first.model.state_dict().values())
    )
