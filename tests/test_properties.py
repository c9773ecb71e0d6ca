"""Properties of the policies and the simulator on random models, servers and plans."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import pytest
from conftest import (
    POLICY_NAMES,
    contiguous_packs,
    fit_to_policy,
    hardwares,
    model_specs,
    plans,
    scenarios,
    simple_hardware,
    tiny_spec,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import harmony
from harmony import DeadlockError, OutOfMemoryError, Plan, build_graph, simulate_graph, swap_volume
from harmony.costs.placement import STAGED_PACKS, HostMemoryError
from harmony.graph import COMPUTE_KINDS, DISK_KINDS, FWDBWD, TRANSFER_KINDS, W_IN, Task, TaskGraph
from harmony.planner.search import SEARCHABLE
from harmony.policies import disk_placement
from harmony.policies.state import host_state
from harmony.simulate import fair_rates, play

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-9


def _standalone(task: Task, links: dict[str, float]) -> float:
    """How long a task takes alone on the server."""
    if task.kind in TRANSFER_KINDS:
        if task.nbytes == 0:
            return 0.0
        rate = min([task.max_rate] + [links[k] for k in task.links])
        return task.nbytes / rate
    return task.duration


# ---- 1, 2, 3: the graph is well formed and plays without deadlock ---------------------
@PROPS
@given(scenarios())
def test_every_graph_checks_and_plays_consistently(case):
    spec, hw, plan = case
    graph = build_graph(spec, hw, plan)
    graph.check()  # property 2

    start, end, peak, memory = play(graph)
    eps = 1e-9 * max(end)
    for t in graph.tasks:
        assert math.isfinite(start[t.id]) and math.isfinite(end[t.id]), t
        assert end[t.id] >= start[t.id], t
        for d in t.deps:
            assert start[t.id] >= end[d] - eps, (
                f"task {t.id} started before its dependency {d} ended"
            )
    # every lane runs one task at a time; compute lanes run in their order
    in_order = graph.in_order_lanes()
    for lane, ids in graph.lanes().items():
        if lane not in in_order:
            ids = sorted(ids, key=lambda i: (start[i], end[i]))
        for a, b in zip(ids, ids[1:]):
            assert start[b] >= end[a] - eps, f"{lane}: task {b} overlaps task {a}"
    # compute tasks last exactly their duration (transfers depend on sharing)
    for t in graph.tasks:
        if t.kind in COMPUTE_KINDS:
            assert math.isclose(end[t.id] - start[t.id], t.duration, rel_tol=1e-9, abs_tol=1e-12)


@PROPS
@given(scenarios())
def test_trace_timeline_lanes_never_overlap(case):
    spec, hw, plan = case
    trace = harmony.simulate(spec, hw, plan)
    tl = trace.timeline
    assert len(tl) == len(build_graph(spec, hw, plan).tasks)
    assert tl[["start_s", "end_s"]].notna().all().all()
    assert (tl.end_s >= tl.start_s).all()
    eps = 1e-9 * trace.iteration_s
    for lane, g in tl.groupby("lane"):
        g = g.sort_values(["start_s", "end_s"])
        assert (g.start_s.to_numpy()[1:] >= g.end_s.to_numpy()[:-1] - eps).all(), lane
    assert math.isclose(trace.iteration_s, tl.end_s.max())


@PROPS
@given(scenarios())
def test_iteration_time_between_lower_bound_and_serial_time(case):
    spec, hw, plan = case
    graph = build_graph(spec, hw, plan)
    s = simulate_graph(graph).summary
    assert s.iteration_s >= s.lower_bound_s * (1 - TOL)
    # Never slower than running every task alone, one after the other: whenever
    # something runs, max-min fair sharing makes at least one task-second of progress per second.
    serial = sum(_standalone(t, graph.links) for t in graph.tasks)
    assert s.iteration_s <= serial * (1 + TOL) + 1e-12


@settings(max_examples=30, deadline=None)
@given(scenarios())
def test_simulation_is_deterministic(case):
    spec, hw, plan = case
    a = harmony.simulate(spec, hw, plan)
    b = harmony.simulate(spec, hw, plan)
    assert a.summary == b.summary
    assert a.timeline.equals(b.timeline)


# ---- 4: simulated bytes are the closed-form swap volume --------------------------------
@PROPS
@given(scenarios())
def test_simulated_bytes_match_closed_form_swap_volume(case):
    spec, hw, plan = case
    simulated = harmony.simulate(spec, hw, plan).summary.bytes_by_kind
    closed = swap_volume(spec, plan)
    for kind in set(simulated) | set(closed):
        got, want = simulated.get(kind, 0.0), closed.get(kind, 0.0)
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6), (
            kind,
            got,
            want,
            plan.describe(),
        )


@st.composite
def disk_scenarios(draw):
    """(spec, hardware, plan, host memory) where the state may spill to disk: 8-12
    layers of 1-2 M parameters in packs of one layer (so that staging three packs
    costs less than the state), host memory from a little less than the least the
    plan can run in (all of its state on disk) to all of it in host memory."""
    spec = draw(model_specs(min_layers=8))
    sizes = st.lists(st.integers(1_000_000, 2_000_000), min_size=len(spec), max_size=len(spec))
    layers = tuple(replace(c, param_numel=n) for c, n in zip(spec.layers, draw(sizes)))
    spec = replace(spec, layers=layers)
    hw = draw(hardwares())
    plan = draw(plans(draw(st.sampled_from(POLICY_NAMES)), len(spec), hw.n_gpus))
    fwd = draw(contiguous_packs(0, len(spec) - 1))
    bwd = tuple((i, i + 1) for i in range(len(spec)))
    plan = fit_to_policy(replace(plan, fwd_packs=fwd, bwd_packs=bwd))
    moved = swap_volume(spec, plan)
    state = [host_state(spec, range(*p)) for p in plan.bwd_packs]
    kept = (
        moved.get("STASH_OUT", 0.0) + moved.get("ACT_OUT", 0.0) + sum(p.gradients for p in state)
    )
    movable = [p.total - p.gradients for p in state]
    least, most = kept + STAGED_PACKS * max(movable), kept + sum(movable)
    low = 0.95 * min(least, most)
    host = int(low + draw(st.floats(0.0, 1.0)) * (most - low))
    return spec, hw, plan, max(1, host)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(disk_scenarios(), st.floats(1e7, 1e10), st.floats(1e7, 1e10))
def test_simulated_disk_bytes_match_closed_form(case, read, write):
    """The disk bytes the simulator moves are the closed form's, and a plan whose
    state cannot fit is refused alike by the closed form and the builder."""
    spec, hw, plan, host = case
    hw = replace(hw, host_memory=host, disk_read=read, disk_write=write)
    try:
        placement = disk_placement(spec, hw, plan)
    except HostMemoryError:
        with pytest.raises(HostMemoryError):
            build_graph(spec, hw, plan)
        return
    graph = build_graph(spec, hw, plan)
    graph.check()
    s = simulate_graph(graph).summary
    closed = swap_volume(spec, plan, hw)
    for kind in DISK_KINDS:
        got, want = s.bytes_by_kind.get(kind, 0.0), closed.get(kind, 0.0)
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6), (kind, got, want)
    assert math.isclose(s.disk_write_bytes, placement.write_bytes_per_step, abs_tol=1e-6)
    assert (s.disk_bytes > 0) == bool(placement.on_disk)
    assert s.iteration_s >= s.lower_bound_s * (1 - TOL)


# ---- 5: input-batch grouping --------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_harmony_pp_weight_traffic_independent_of_microbatches(data):
    spec = data.draw(model_specs())
    hw = data.draw(hardwares())
    plan = data.draw(plans("harmony-pp", len(spec), hw.n_gpus))
    B = plan.minibatch
    one = Plan("harmony-pp", plan.n_gpus, B, B, B, plan.fwd_packs, plan.bwd_packs, plan.options)
    w = harmony.simulate(spec, hw, plan).summary.bytes_by_kind.get(W_IN, 0.0)
    w_one = harmony.simulate(spec, hw, one).summary.bytes_by_kind.get(W_IN, 0.0)
    assert math.isclose(w, w_one, rel_tol=1e-12)
    # one pass of the forward packs and one of the backward packs (fused pack included)
    assert math.isclose(
        w, spec.weight_bytes(0, plan.bwd_packs[-1][0]) + spec.weight_bytes(), rel_tol=1e-12
    )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_virtual_memory_weight_traffic_grows_with_microbatches(data):
    spec = data.draw(model_specs())
    hw = data.draw(hardwares())
    plan = data.draw(plans("harmony-no-grouping", len(spec), hw.n_gpus))
    B, u = plan.minibatch, plan.fwd_microbatch
    single = Plan("harmony-no-grouping", 1, B, B, B, plan.fwd_packs, plan.bwd_packs, plan.options)
    trace = harmony.simulate(spec, hw, plan)
    w = trace.summary.bytes_by_kind.get(W_IN, 0.0)
    w_single = harmony.simulate(spec, hw, single).summary.bytes_by_kind.get(W_IN, 0.0)
    # replicas split the minibatch as evenly as possible, then into microbatches of u
    shares = [B // plan.n_gpus + (r < B % plan.n_gpus) for r in range(plan.n_gpus)]
    n_mb = sum(-(-s // u) for s in shares if s)
    assert n_mb == (trace.timeline.kind == FWDBWD).sum()  # every microbatch ends in the fused pack
    assert math.isclose(w, n_mb * w_single, rel_tol=1e-12)


# ---- 6: memory ledger ------------------------------------------------------------------
@PROPS
@given(scenarios())
def test_memory_peak_covers_every_buffer_and_ledger_returns_to_zero(case):
    spec, hw, plan = case
    graph = build_graph(spec, hw, plan)
    trace = simulate_graph(graph)
    peak = trace.summary.peak_memory
    largest: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    for b in graph.buffers:
        largest[b.device] = max(largest[b.device], b.nbytes)
        total[b.device] += b.nbytes
    for dev, biggest in largest.items():
        assert peak[dev] >= biggest * (1 - TOL), dev
        assert peak[dev] <= total[dev] * (1 + TOL), dev
    for dev, steps in trace.memory.items():
        scale = max(1.0, total[dev])
        assert abs(steps[-1][1]) <= 1e-9 * scale, (
            f"{dev} still holds {steps[-1][1]} bytes at the end"
        )
        assert min(b for _, b in steps) >= -1e-9 * scale, f"{dev} went negative"
        assert math.isclose(max(b for _, b in steps), peak[dev], rel_tol=1e-12)
        times = [t for t, _ in steps]
        assert times == sorted(times)
    assert trace.summary.fits == all(peak[d] <= hw.gpu_memory for d in peak)


# ---- 7: the planner only returns plans that fit ---------------------------------------------
@st.composite
def search_cases(draw):
    spec = draw(model_specs(max_layers=8))
    from harmony.planner.search import bwd_pack_bytes

    need = max(bwd_pack_bytes(spec, i, i + 1, 1) for i in range(len(spec)))
    factor = draw(st.floats(1.5, 40.0))
    memory = st.just(max(1, int(need * factor)))
    hw = draw(hardwares(max_gpus=3, memory=memory))
    minibatch = draw(st.integers(1, 12))
    policies = draw(st.lists(st.sampled_from(SEARCHABLE), min_size=1, max_size=3, unique=True))
    return spec, hw, minibatch, policies


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(search_cases())
def test_search_returns_only_plans_that_fit(case):
    spec, hw, minibatch, policies = case
    try:
        df = harmony.search(spec, hw, minibatch, policies=policies, workers=1)
    except OutOfMemoryError as e:
        assert "no plan for" in str(e)  # a real search that found nothing, not the up-front check
        assume(False)
    assert list(df.iteration_s) == sorted(df.iteration_s)
    assert set(df.policy) <= set(policies)
    for row in df.itertuples():
        plan = row.plan
        s = harmony.simulate(spec, hw, plan).summary
        for dev, used in s.peak_memory.items():
            assert used <= hw.gpu_memory, (plan.describe(), dev, used)
        assert s.fits
        assert math.isclose(s.iteration_s, row.iteration_s, rel_tol=1e-12)


# ---- 8: bandwidth sharing -----------------------------------------------------------------------
def _graph(tasks: list[Task], links: dict[str, float]) -> TaskGraph:
    return TaskGraph(
        tasks=tasks, buffers=[], links=links, memory_capacity={}, samples=1, cpu_workers=1
    )


def _transfer(
    i: int, lane: str, nbytes: float, links: tuple[str, ...], deps=(), seq=None, **kw
) -> Task:
    return Task(
        i, "P2P", lane, "gpu0", seq or (0, i), list(deps), nbytes=nbytes, links=links, **kw
    )


def test_two_transfers_sharing_one_link_take_total_bytes_over_bandwidth():
    g = _graph([_transfer(0, "a", 30.0, ("L",)), _transfer(1, "b", 50.0, ("L",))], {"L": 10.0})
    start, end, _, _ = play(g)
    assert start == [0.0, 0.0]
    assert math.isclose(end[0], 6.0)  # 30 bytes at 5 B/s while shared
    assert math.isclose(end[1], 8.0)  # then the rest alone: (30 + 50) / 10
    tr = simulate_graph(g)
    assert math.isclose(tr.iteration_s, 8.0)
    assert math.isclose(tr.summary.lower_bound_s, 8.0)


def test_transfer_on_a_route_is_limited_by_its_narrowest_link_and_rate_cap():
    g = _graph(
        [
            _transfer(0, "a", 40.0, ("fast", "slow")),
            _transfer(1, "b", 40.0, ("fast",), max_rate=4.0),
        ],
        {"fast": 100.0, "slow": 8.0},
    )
    _, end, _, _ = play(g)
    assert math.isclose(end[0], 5.0)
    assert math.isclose(end[1], 10.0)


def _ones(active):
    """``fair_rates``'s input with every byte taking one unit of each link."""
    return {tid: (links, cap, (1.0,) * len(links)) for tid, (links, cap) in active.items()}


def test_fair_rates_hand_example():
    inf = math.inf
    rates = fair_rates(
        _ones({1: (("A",), inf), 2: (("A", "B"), inf), 3: (("B",), inf)}), {"A": 10.0, "B": 4.0}
    )
    assert rates == pytest.approx({1: 8.0, 2: 2.0, 3: 2.0})
    # a cap frees bandwidth for the others
    rates = fair_rates(_ones({1: (("A",), 1.0), 2: (("A",), inf), 3: (("A",), inf)}), {"A": 9.0})
    assert rates == pytest.approx({1: 1.0, 2: 4.0, 3: 4.0})
    assert fair_rates(_ones({7: (("A", "B"), 3.0)}), {"A": 10.0, "B": 4.0}) == {7: 3.0}


def test_fair_rates_with_costs_share_a_disk_s_time():
    """A disk reading 4 B/s and writing 2 B/s whose reads and writes share its time:
    link D of capacity 1 (seconds per second), a byte read takes 1/4 of it, a
    byte written 1/2. Alone each streams at its own bandwidth; together they get
    one rate r with r/4 + r/2 = 1."""
    inf = math.inf
    links = {"R": 4.0, "W": 2.0, "D": 1.0}
    read = (("R", "D"), inf, (1.0, 0.25))
    write = (("W", "D"), inf, (1.0, 0.5))
    assert fair_rates({1: read}, links) == {1: 4.0}
    assert fair_rates({2: write}, links) == {2: 2.0}
    assert fair_rates({1: read, 2: write}, links) == pytest.approx({1: 4 / 3, 2: 4 / 3})
    # a capped write leaves the rest of the disk's time to the read
    capped = (("W", "D"), 1.0, (1.0, 0.5))
    assert fair_rates({1: read, 2: capped}, links) == pytest.approx({1: 2.0, 2: 1.0})


@st.composite
def sharing_problems(draw):
    names = [f"L{i}" for i in range(draw(st.integers(1, 4)))]
    capacity = {n: draw(st.floats(0.5, 100.0)) for n in names}
    active = {}
    for tid in range(draw(st.integers(1, 7))):
        links = tuple(
            draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
        )
        cap = draw(st.one_of(st.just(math.inf), st.floats(0.1, 50.0)))
        costs = tuple(draw(st.one_of(st.just(1.0), st.floats(0.05, 5.0))) for _ in links)
        active[tid] = (links, cap, costs)
    return active, capacity


@settings(max_examples=300, deadline=None)
@given(sharing_problems())
def test_fair_rates_are_max_min_fair(problem):
    active, capacity = problem
    rates = fair_rates(active, capacity)
    assert set(rates) == set(active)
    load = defaultdict(float)
    for tid, (links, cap, costs) in active.items():
        assert 0 < rates[tid] <= cap * (1 + 1e-9)
        for link, c in zip(links, costs):
            load[link] += rates[tid] * c
    for link, used in load.items():
        assert used <= capacity[link] * (1 + 1e-9), link
    # Max-min fairness: every transfer is at its cap or crosses a saturated link on
    # which no other transfer gets more than it does (so it cannot grow without
    # taking from someone slower or equal).
    for tid, (links, cap, _) in active.items():
        r = rates[tid]
        if math.isclose(r, cap, rel_tol=1e-9):
            continue
        assert any(
            math.isclose(load[link], capacity[link], rel_tol=1e-9)
            and all(rates[o] <= r * (1 + 1e-9) for o, (ol, _, _) in active.items() if link in ol)
            for link in links
        ), (tid, rates, capacity)


# ---- 9: deadlock is reported, not hung ----------------------------------------------------------
def test_lane_order_inconsistent_with_dependencies_raises_deadlock():
    # lane X: [a]; lane Y: [b, c]. a waits on c, c waits behind b on lane Y, b waits on a.
    a = Task(0, "FWD", "X", "gpu0", (1, 0), [2], duration=1.0, what="task-a")
    b = Task(1, "FWD", "Y", "gpu1", (1, 0), [0], duration=1.0, what="task-b")
    c = Task(2, "FWD", "Y", "gpu1", (2, 0), [], duration=1.0, what="task-c")
    g = _graph([a, b, c], {})
    with pytest.raises(DeadlockError) as err:
        play(g)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "X: task 0" in msg and "task-a" in msg and "[2]" in msg
    assert "Y: task 1" in msg and "task-b" in msg and "[0]" in msg
    with pytest.raises(AssertionError):  # the graph also breaks the seq invariant
        g.check()


def test_stuck_graph_after_partial_progress_reports_only_stuck_heads():
    # d runs first and finishes; then the same cycle as above is stuck.
    d = Task(0, "FWD", "Z", "gpu2", (0, 0), [], duration=2.0, what="task-d")
    a = Task(1, "FWD", "X", "gpu0", (1, 0), [3, 0], duration=1.0, what="task-a")
    b = Task(2, "FWD", "Y", "gpu1", (1, 0), [1], duration=1.0, what="task-b")
    c = Task(3, "FWD", "Y", "gpu1", (2, 0), [], duration=1.0, what="task-c")
    with pytest.raises(DeadlockError) as err:
        play(_graph([d, a, b, c], {}))
    msg = str(err.value)
    assert "task-a" in msg and "task-b" in msg
    assert "task-d" not in msg and "Z:" not in msg
    assert "waits on tasks [3]" in msg  # the finished dependency 0 is not listed


# ---- plans as values ----------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.sampled_from(POLICY_NAMES).flatmap(lambda p: plans(p, 12, 4)))
def test_plan_json_round_trip(plan):
    back = Plan.from_json(plan.to_json())
    assert back == plan and hash(back) == hash(plan)
    assert back.validate(12) is back


def test_tiny_spec_fixture_is_sane():
    # guards the hand-computed tests against a broken fixture
    spec = tiny_spec(3)
    assert len(spec) == 3 and spec.weight_bytes() == 3 * 4_000_000
    assert simple_hardware(2).n_gpus == 2
