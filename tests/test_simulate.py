"""The simulator against hand calculations, and the Trace it returns."""

from __future__ import annotations

import gc
import json
import math

import pytest
from conftest import simple_hardware, tiny_spec

import harmony
from harmony import Plan
from harmony.simulate import gc_paused
from harmony.trace import TIMELINE_COLUMNS

MS = 1e-3


def _rows(trace, **where):
    tl = trace.timeline
    for k, v in where.items():
        tl = tl[tl[k].apply(lambda x, v=v: x == v)]
    return tl


def _one(trace, **where):
    rows = _rows(trace, **where)
    assert len(rows) == 1, (where, rows)
    return rows.iloc[0]


# ---- hand calculations ------------------------------------------------------------------
def test_single_fused_pack_on_one_gpu_matches_hand_calculation():
    # 2 layers of 1e6 fp32 params (4 MB each), 1 MB of input per sample, 8 B of labels,
    # backward 3 ms per sample per layer, update 10 ms per layer; every link 1 GB/s.
    spec = tiny_spec(2)
    hw = simple_hardware(1)
    plan = Plan("harmony-pp", 1, 4, 4, 4, (), ((0, 2),))
    trace = harmony.simulate(spec, hw, plan)
    # Everything is on one path: weights, inputs, labels in (one h2d lane, FIFO),
    # the fused forward+loss+backward, gradients out, then the CPU update.
    w_in = 8e6 / 1e9
    x_in = 4 * 1e6 / 1e9
    y_in = 4 * 8 / 1e9
    compute = 2 * 3 * MS * 4
    g_out = 8e6 / 1e9
    update = 2 * 10 * MS
    assert trace.iteration_s == pytest.approx(
        w_in + x_in + y_in + compute + g_out + update, rel=1e-12
    )
    assert trace.summary.bytes_by_kind == pytest.approx(
        {"W_IN": 8e6, "DATA_IN": 4e6 + 32, "G_OUT": 8e6}
    )
    assert trace.summary.swap_bytes == pytest.approx(20e6 + 32)
    fused = _one(trace, kind="FWDBWD")
    assert fused.start_s == pytest.approx(w_in + x_in + y_in)
    assert fused.end_s - fused.start_s == pytest.approx(compute)
    upd = _one(trace, kind="UPD")
    assert upd.start_s == pytest.approx(fused.end_s + g_out)
    # weights 8 MB + gradient 8 MB + inputs 4 MB + labels + backward working memory,
    # which adds up over the layers of a pack (2 x 2 MB)
    assert trace.summary.peak_memory == pytest.approx({"gpu0": 24e6 + 32})
    assert trace.summary.fits
    assert trace.summary.samples_per_s == pytest.approx(4 / trace.iteration_s)


def test_two_packs_without_prefetch_match_hand_calculation():
    # forward pack [0,1), fused pack [1,2), backward pack [0,1); one microbatch of 4.
    spec = tiny_spec(2, target=0.0)  # no labels: nothing tiny on the h2d lane
    hw = simple_hardware(1)
    plan = Plan("harmony-pp", 1, 4, 4, 4, ((0, 1),), ((0, 1), (1, 2)), {"prefetch_packs": 1})
    trace = harmony.simulate(spec, hw, plan)
    t = 4 * MS  # every 4 MB transfer
    # h2d: W(0) [0,4], inputs [4,8]; FWD [8,12]; W(1) waits for FWD to end: [12,16];
    # FWDBWD [16,28]; stashed layer-0 input (the minibatch itself) [16,20] meanwhile;
    # W(0) again only after FWDBWD: [28,32]; REC [32,36] (the forward time), BWD [36,44];
    # G_OUT(0) [44,48]; UPD(0) [48,58].
    # G_OUT(1) [28,32] and UPD(1) [32,42] overlap the backward of pack 0.
    expect = {
        ("FWD", 0): (2 * t, 3 * t),
        ("FWDBWD", 1): (4 * t, 7 * t),
        ("REC", 0): (8 * t, 9 * t),
        ("BWD", 0): (9 * t, 11 * t),
    }
    for (kind, pack), (s, e) in expect.items():
        row = _one(trace, kind=kind, pack=pack)
        assert (row.start_s, row.end_s) == pytest.approx((s, e)), (kind, pack)
    upd1, upd0 = _one(trace, kind="UPD", pack=1), _one(trace, kind="UPD", pack=0)
    assert (upd1.start_s, upd1.end_s) == pytest.approx((32 * MS, 42 * MS))
    assert upd1.start_s < _one(trace, kind="BWD", pack=0).end_s  # update overlaps backward
    assert (upd0.start_s, upd0.end_s) == pytest.approx((48 * MS, 58 * MS))
    assert trace.iteration_s == pytest.approx(58 * MS)
    assert trace.iteration_s == _rows(trace, kind="UPD").end_s.max()  # ends with the last update
    stash = _one(trace, kind="STASH_IN")
    assert (stash.start_s, stash.end_s) == pytest.approx((16 * MS, 20 * MS))
    assert trace.summary.bytes_by_kind == pytest.approx(
        {"W_IN": 12e6, "DATA_IN": 4e6, "STASH_IN": 4e6, "G_OUT": 8e6}
    )
    # peak during the fused pack: its weights + gradient (8 MB), the activation into layer 1
    # (4 MB), the prefetched stash (4 MB), the gradient into layer 1 (4 MB), 2 MB working
    assert trace.summary.peak_memory["gpu0"] == pytest.approx(22e6)


# ---- prefetch -----------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_overlaps_next_weights_with_compute(prefetch):
    spec = tiny_spec(2, target=0.0)
    hw = simple_hardware(1)
    plan = Plan(
        "harmony-pp", 1, 4, 4, 4, ((0, 1),), ((0, 1), (1, 2)), {"prefetch_packs": prefetch}
    )
    trace = harmony.simulate(spec, hw, plan)
    fwd = _one(trace, kind="FWD", pack=0)
    w_next = _one(trace, kind="W_IN", pack=1)
    assert w_next.layers == (1, 2)
    if prefetch == 2:
        assert w_next.start_s < fwd.end_s
    else:
        assert w_next.start_s >= fwd.end_s


def _prefetch_chain(prefetch):
    spec = tiny_spec(6)
    packs = tuple((i, i + 1) for i in range(6))
    plan = Plan("harmony-pp", 1, 4, 2, 2, packs[:-1], packs, {"prefetch_packs": prefetch})
    return harmony.simulate(spec, simple_hardware(1), plan)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_prefetch_window_bounds_resident_weight_groups(prefetch):
    trace = _prefetch_chain(prefetch)
    # a load starts only after the group `prefetch` back on the GPU has finished computing
    tl = trace.timeline
    loads = tl[tl.kind == "W_IN"].sort_values("start_s")
    compute = tl[tl.kind.isin(["FWD", "FWDBWD", "BWD"])]
    group_ends = sorted(g.end_s.max() for _, g in compute.groupby(["kind", "pack"], sort=False))
    assert len(loads) == len(group_ends) == 11
    overlapped = 0
    for i, start in enumerate(loads.start_s):
        if i >= prefetch:
            assert start >= group_ends[i - prefetch] - 1e-12
        if i >= 1 and start < group_ends[i - 1]:
            overlapped += 1
    assert (overlapped > 0) == (prefetch > 1)


def test_double_buffering_is_faster_and_holds_more_memory():
    (t1, m1), (t2, m2), (t3, m3) = [
        (tr.iteration_s, tr.summary.peak_memory["gpu0"]) for tr in map(_prefetch_chain, (1, 2, 3))
    ]
    assert t1 > t2
    assert m1 < m2 <= m3


def test_deeper_prefetch_is_not_slower():
    assert _prefetch_chain(3).iteration_s <= _prefetch_chain(2).iteration_s * (1 + 1e-9)


@pytest.mark.parametrize("policy", sorted(harmony.POLICIES))
def test_single_layer_model_runs_under_every_policy(policy):
    spec = tiny_spec(1)
    plan = Plan(policy, 1, 4, 2, 2, (), ((0, 1),))
    trace = harmony.simulate(spec, simple_hardware(1), plan)
    closed = harmony.swap_volume(spec, plan)
    got = trace.summary.bytes_by_kind
    for kind in set(got) | set(closed):
        assert got.get(kind, 0.0) == pytest.approx(closed.get(kind, 0.0)), kind
    assert len(_rows(trace, kind="FWDBWD")) == 2 and len(_rows(trace, kind="FWD")) == 0
    # grouping policies run the two microbatches under one weight load; per-microbatch ones load
    # twice
    assert len(_rows(trace, kind="W_IN")) == (
        2 if harmony.policies.get_policy(policy).PER_MICROBATCH else 1
    )


# ---- Trace ----------------------------------------------------------------------------------
@pytest.fixture
def pp_trace():
    spec = tiny_spec(4)
    plan = Plan("harmony-pp", 2, 6, 4, 2, ((0, 1), (1, 3)), ((0, 2), (2, 3), (3, 4)))
    return harmony.simulate(spec, simple_hardware(2), plan)


def test_timeline_columns(pp_trace):
    cols = list(pp_trace.timeline.columns)
    assert cols[:9] == [
        "device",
        "lane",
        "kind",
        "model",
        "pack",
        "microbatch",
        "start_s",
        "end_s",
        "bytes",
    ]
    assert cols[:9] == TIMELINE_COLUMNS
    tl = pp_trace.timeline
    assert set(tl.device) == {"gpu0", "gpu1", "cpu"}
    assert set(tl.kind) >= {
        "FWD",
        "FWDBWD",
        "BWD",
        "UPD",
        "W_IN",
        "G_OUT",
        "P2P",
        "DATA_IN",
        "STASH_IN",
    }
    assert (tl[tl.kind.isin(["W_IN", "G_OUT", "P2P"])].bytes > 0).all()
    assert (tl[tl.kind.isin(["FWD", "BWD", "UPD"])].bytes == 0).all()


def test_chrome_trace_is_valid_json(pp_trace, tmp_path):
    path = pp_trace.to_chrome(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert len(events) == len(pp_trace.timeline)
    assert {e["ph"] for e in events} == {"X"}
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert {"name", "cat", "pid", "tid", "args"} <= set(e)
    last = max(e["ts"] + e["dur"] for e in events)
    assert last == pytest.approx(pp_trace.iteration_s * 1e6)


def test_summary_keys_and_values(pp_trace):
    s = pp_trace.summary
    as_json = json.loads(json.dumps(s.to_dict()))
    for key in (
        "iteration_s",
        "samples_per_s",
        "bytes_by_kind",
        "swap_bytes",
        "peak_memory",
        "fits",
        "lower_bound_s",
        "lower_bound_by",
        "time_over_lower_bound",
        "executor",
    ):
        assert as_json[key] == getattr(s, key), key
    assert s.samples_per_s == pytest.approx(6 / s.iteration_s)
    host_kinds = ("W_IN", "G_OUT", "STASH_OUT", "STASH_IN", "ACT_OUT", "ACT_IN", "DATA_IN")
    assert s.swap_bytes == pytest.approx(
        sum(v for k, v in s.bytes_by_kind.items() if k in host_kinds)
    )
    assert set(s.peak_memory) == {"gpu0", "gpu1"}
    assert s.policy == "harmony-pp" and s.model == "tiny"
    assert 0 < s.lower_bound_s <= s.iteration_s


def test_memory_timeline(pp_trace):
    mt = pp_trace.memory_timeline()
    assert list(mt.columns) == ["device", "time_s", "bytes"]
    for dev, g in mt.groupby("device"):
        assert g.bytes.max() == pytest.approx(pp_trace.summary.peak_memory[dev])
        assert g.bytes.iloc[-1] == pytest.approx(0.0, abs=1e-3)


def test_fits_is_false_when_peak_exceeds_capacity():
    spec = tiny_spec(2)
    plan = Plan("harmony-pp", 1, 4, 4, 4, (), ((0, 2),))
    trace = harmony.simulate(spec, simple_hardware(1, memory=20_000_000), plan)  # peak is 22 MB
    assert not trace.summary.fits
    assert trace.summary.memory_capacity == {"gpu0": 20e6}


# ---- multi-GPU ------------------------------------------------------------------------------
def test_harmony_dp_reduces_gradients_and_sends_no_activations():
    spec = tiny_spec(4)
    for k in (2, 3):
        plan = Plan("harmony-dp", k, 12, 2, 2, ((0, 2),), ((0, 2), (2, 4)))
        trace = harmony.simulate(spec, simple_hardware(k), plan)
        got = trace.summary.bytes_by_kind
        assert got["REDUCE"] == pytest.approx(spec.grad_bytes() * (k - 1))
        assert got.get("P2P", 0.0) == 0.0
        assert got["G_OUT"] == pytest.approx(spec.grad_bytes())  # each GPU sends its shard
        assert got["W_IN"] == pytest.approx(k * (spec.weight_bytes(0, 2) + spec.weight_bytes()))
        # one update per GPU per backward pack, each on a share of the parameters
        upd = _rows(trace, kind="UPD")
        assert len(upd) == k * 2
        # every GPU ran a share of the minibatch
        fused = _rows(trace, kind="FWDBWD")
        assert set(fused.device) == {f"gpu{g}" for g in range(k)}


def test_harmony_pp_on_two_gpus_moves_activations_gpu_to_gpu():
    spec = tiny_spec(4)
    plan = Plan("harmony-pp", 2, 8, 4, 4, ((0, 2),), ((0, 2), (2, 4)))
    trace = harmony.simulate(spec, simple_hardware(2), plan)
    got = trace.summary.bytes_by_kind
    assert got["P2P"] > 0
    # activations into layer 2 forward, and their gradient backward
    assert got["P2P"] == pytest.approx(2 * spec.input_bytes(2, 8))
    assert got.get("REDUCE", 0.0) == 0.0
    assert "ACT_OUT" not in got
    # packs alternate GPUs in task order: FWD on gpu0, fused on gpu1, BWD on gpu0
    assert set(_rows(trace, kind="FWD").device) == {"gpu0"}
    assert set(_rows(trace, kind="FWDBWD").device) == {"gpu1"}
    assert set(_rows(trace, kind="BWD").device) == {"gpu0"}


def test_p2p_routes_direct_with_peer_access_else_through_host():
    spec = tiny_spec(4)
    plan = Plan("harmony-pp", 2, 8, 8, 8, ((0, 2),), ((0, 2), (2, 4)))
    nbytes = spec.input_bytes(2, 8)

    def p2p_tasks(hw):
        return [t for t in harmony.build_graph(spec, hw, plan).tasks if t.kind == "P2P"]

    direct = p2p_tasks(simple_hardware(2, link=1e9, p2p=0.5e9))
    assert len(direct) == 2 and all(t.nbytes == nbytes for t in direct)
    fwd, bwd = sorted(direct, key=lambda t: t.seq)
    assert fwd.links == ("gpu0.d2h", "gpu1.h2d") and fwd.max_rate == 0.5e9
    assert bwd.links == ("gpu1.d2h", "gpu0.h2d")
    via_host = p2p_tasks(simple_hardware(2, link=1e9, p2p=None))
    assert len(via_host) == 2
    for t in via_host:  # staged: source GPU -> host -> this GPU, through the shared switch
        dst = int(t.device[3:])
        src = 1 - dst
        assert set(t.links) == {f"gpu{src}.d2h", "switch0.up", f"gpu{dst}.h2d", "switch0.down"}
        assert t.max_rate == math.inf
    # GPUs on different switches never copy directly, even with peer access
    apart = p2p_tasks(simple_hardware(2, p2p=4e9, gpus_per_switch=1))
    assert all("switch0.up" in t.links or "switch1.up" in t.links for t in apart)
    # the peer cap binds in the simulation
    trace = harmony.simulate(spec, simple_hardware(2, link=1e9, p2p=0.5e9), plan)
    p2p = _rows(trace, kind="P2P")
    assert ((p2p.end_s - p2p.start_s) >= nbytes / 0.5e9 * (1 - 1e-9)).all()


def test_shared_uplink_slows_host_transfers_of_gpus_on_one_switch():
    spec = tiny_spec(4, fwd_s=1e-6, bwd_s=1e-6, update_s=0.0)  # transfer-bound
    plan = Plan("harmony-dp", 2, 8, 4, 4, ((0, 2),), ((0, 2), (2, 4)))
    one_switch = harmony.simulate(spec, simple_hardware(2, gpus_per_switch=2), plan)
    two_switches = harmony.simulate(spec, simple_hardware(2, gpus_per_switch=1), plan)
    assert one_switch.summary.bytes_by_kind == two_switches.summary.bytes_by_kind
    assert one_switch.iteration_s > 1.5 * two_switches.iteration_s
    assert one_switch.summary.lower_bound_by.startswith("link:switch0")


def test_graph_info_and_unknown_policy():
    spec = tiny_spec(2)
    plan = Plan("no-such-policy", 1, 4, 4, 4, (), ((0, 2),))
    with pytest.raises(harmony.HarmonyError, match="unknown policy 'no-such-policy'.*harmony-pp"):
        harmony.simulate(spec, simple_hardware(1), plan)


def test_plan_with_more_gpus_than_hardware_is_rejected():
    spec = tiny_spec(2)
    plan = Plan("harmony-dp", 3, 4, 1, 1, (), ((0, 2),))
    with pytest.raises(harmony.HarmonyError, match="3 GPUs.*has 2"):
        harmony.simulate(spec, simple_hardware(2), plan)


def test_plan_not_matching_the_model_is_rejected():
    spec = tiny_spec(4)
    plan = Plan("harmony-pp", 1, 4, 4, 4, (), ((0, 2),))
    with pytest.raises(harmony.HarmonyError, match="cover layers 0..3"):
        harmony.simulate(spec, simple_hardware(1), plan)


def test_virtual_memory_requires_equal_microbatches():
    spec = tiny_spec(2)
    plan = Plan("harmony-no-grouping", 1, 4, 2, 1, ((0, 1),), ((0, 1), (1, 2)))
    with pytest.raises(
        harmony.HarmonyError, match="fwd_microbatch .2. must equal bwd_microbatch .1."
    ):
        harmony.simulate(spec, simple_hardware(1), plan)
    with pytest.raises(harmony.HarmonyError, match="must equal"):
        harmony.swap_volume(spec, plan)


def test_virtual_memory_swaps_weights_every_microbatch_and_harmony_does_not():
    spec = tiny_spec(4)
    hw = simple_hardware(1)
    packs_f, packs_b = ((0, 2),), ((0, 2), (2, 4))
    vm = harmony.simulate(spec, hw, Plan("harmony-no-grouping", 1, 8, 2, 2, packs_f, packs_b))
    pp = harmony.simulate(spec, hw, Plan("harmony-pp", 1, 8, 2, 2, packs_f, packs_b))
    w = spec.weight_bytes(0, 2) + spec.weight_bytes()
    assert pp.summary.bytes_by_kind["W_IN"] == pytest.approx(w)
    assert vm.summary.bytes_by_kind["W_IN"] == pytest.approx(4 * w)
    assert vm.summary.bytes_by_kind["G_OUT"] == pytest.approx(4 * spec.grad_bytes())
    assert pp.iteration_s < vm.iteration_s


def test_gc_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the outer one turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed play")
    assert gc.isenabled()


def test_gc_paused_leaves_the_young_objects_it_made_out_of_the_next_collection():
    # as a process has it before anything froze objects (a test may have)
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        _young_objects_are_not_walked()
    finally:
        if frozen:
            gc.freeze()


def _young_objects_are_not_walked():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with gc_paused():
            made = [[i] for i in range(5000)]  # far more than a young collection's threshold
        after = [[i] for i in range(50)]  # allocations that would start one
    finally:
        gc.callbacks.remove(seen)
    assert collections == []  # nothing walked what the pause made
    assert gc.get_freeze_count() == 0  # moved to the oldest generation, not left frozen
    assert len(made) == 5000 and len(after) == 50


def test_gc_paused_keeps_what_the_process_froze_itself():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            pass
        assert gc.get_freeze_count() == frozen  # not unfrozen by the pause
    finally:
        gc.unfreeze()
