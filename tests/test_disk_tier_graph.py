"""The disk tier in the task graph: a server's disk link, where the plan's state
goes when host memory is short, the DISK_IN / DISK_OUT transfers around each
update (read ahead, written behind), weight loads that read through it, their
bytes in closed form, the simulator's lower bound and the search's view."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import simple_hardware, tiny_spec

import harmony
from harmony import Plan
from harmony.costs.hardware import (
    NVME_PCIE4_READ,
    NVME_PCIE4_WRITE,
    PRESETS,
    Hardware,
    parse_disk,
)
from harmony.costs.placement import STAGED_PACKS, STASH_SLOTS, HostMemoryError
from harmony.costs.spec import Tie
from harmony.engine.tiers import NVME_PCIE4
from harmony.errors import HarmonyError
from harmony.graph import DISK_IN, DISK_OUT, UPD, W_IN, DiskState
from harmony.policies import (
    build_graph,
    disk_placement,
    gradient_window,
    swap_volume,
    without_weights_with_update,
)
from harmony.policies.disk_tier import (
    READ,
    SHARED,
    WRITE,
    stash_piece_bytes,
    windowed_gradients,
)
from harmony.policies.state import host_state

MB = 1e6
# 6 layers of 1e6 fp32 parameters: per layer 4 MB of weights, 4 MB of gradients and
# 8 MB of AdamW state; updates of 50 ms, so a disk at 100 MB/s reads a pack's
# optimizer state (80 ms) in about the time of an update
SPEC = tiny_spec(6, update_s=0.05)
PLAN = Plan.uniform("harmony-pp", 1, 4, 2, 6, 1)
DISK = (100 * MB, 100 * MB)


def host_for(spec, plan) -> int:
    """Host memory that sends every pack's optimizer state to disk and nothing else:
    stashes, gradients (two packs' in slots, where the policy holds them so) and
    weights, and the staging of three packs' optimizer state."""
    stash = swap_volume(spec, plan)["STASH_OUT"]
    gradients = windowed_gradients(spec, plan) if gradient_window(plan.policy) else 24 * MB
    return int(stash + gradients + 24 * MB + STAGED_PACKS * 8 * MB)


def server(host: int, disk=DISK, n_gpus: int = 1, **kw) -> Hardware:
    return replace(simple_hardware(n_gpus, **kw), host_memory=host).with_disk(disk)


# ---- the disk link ------------------------------------------------------------------
def test_hardware_disk_link_is_validated_and_named():
    hw = simple_hardware(1)
    assert hw.disk_read is None and not hw.has_disk
    nvme = hw.with_disk("nvme")
    assert (nvme.disk_read, nvme.disk_write) == (NVME_PCIE4_READ, NVME_PCIE4_WRITE)
    assert (NVME_PCIE4.read, NVME_PCIE4.write) == (NVME_PCIE4_READ, NVME_PCIE4_WRITE)
    assert hw.with_disk("3GB/s, 2GB/s").disk_write == 2e9
    assert nvme.with_disk(None).disk_read is None
    assert hw.with_host_memory("24GiB").host_memory == 24 * 1024**3
    with pytest.raises(HarmonyError, match="both disk_read and disk_write"):
        replace(hw, disk_read=1e9)
    with pytest.raises(HarmonyError, match="disk_write must be positive or None"):
        replace(hw, disk_read=1e9, disk_write=0.0)
    with pytest.raises(HarmonyError, match="give a disk by name"):
        parse_disk("floppy")
    with pytest.raises(HarmonyError, match="cannot read disk read bandwidth"):
        parse_disk("fast,2GB/s")
    assert all(p.disk_read is None for p in PRESETS.values())  # presets fit their state
    # a disk whose reads and writes share its time
    assert parse_disk("3GB/s,2GB/s, Shared") == (3e9, 2e9, True)
    assert parse_disk("nvme")[2] is False and parse_disk("3GB/s,2GB/s")[2] is False
    shared = hw.with_disk("4GB/s,2GB/s,shared")
    assert shared.disk_shared and not hw.with_disk((4e9, 2e9)).disk_shared
    assert hw.with_disk((4e9, 2e9, True)).disk_shared and not shared.with_disk(None).disk_shared
    assert shared.disk_seconds(8e9, 2e9) == 2 + 1  # one after the other
    assert shared.with_disk((4e9, 2e9)).disk_seconds(8e9, 2e9) == 2  # at once
    with pytest.raises(HarmonyError, match="',shared' after them"):
        parse_disk("3GB/s,2GB/s,duplex")
    with pytest.raises(HarmonyError, match="True only with a disk"):
        replace(hw, disk_shared=True)


# ---- placement ------------------------------------------------------------------------
def test_a_plan_that_fits_host_memory_has_no_disk_tasks_and_the_same_trace():
    roomy = simple_hardware(1)
    with_disk = roomy.with_disk("nvme")
    graph = build_graph(SPEC, with_disk, PLAN)
    assert not [t for t in graph.tasks if t.kind in (DISK_IN, DISK_OUT)]
    assert READ not in graph.links and "disk" not in graph.info
    a, b = harmony.simulate(SPEC, roomy, PLAN), harmony.simulate(SPEC, with_disk, PLAN)
    assert a.summary == b.summary and a.timeline.equals(b.timeline)
    assert b.summary.disk_bytes == 0
    assert swap_volume(SPEC, PLAN, with_disk) == swap_volume(SPEC, PLAN)


def test_state_that_does_not_fit_says_what_to_set():
    short = replace(simple_hardware(1), host_memory=host_for(SPEC, PLAN))
    with pytest.raises(HostMemoryError, match=r"give the server a disk tier \(--disk nvme"):
        build_graph(SPEC, short, PLAN)
    with pytest.raises(HostMemoryError, match="needs at least .* even with its optimizer state"):
        build_graph(SPEC, server(30 * MB), PLAN)
    # a baseline that swaps its state to the GPU keeps it in host memory
    swap = Plan.uniform("layer-swap", 1, 4, 2, 6, 1, gpu_optimizer=True)
    with pytest.raises(HostMemoryError, match="run without gpu_optimizer"):
        build_graph(SPEC, server(host_for(SPEC, swap)), swap)
    # ... and one whose state stays on its GPUs keeps none there
    resident = Plan("model-parallel", 1, 4, 2, 2, PLAN.bwd_packs[:-1], PLAN.bwd_packs)
    resident = resident.with_options(gpu_optimizer=True)
    tiny_host = replace(simple_hardware(1), host_memory=1)
    assert not disk_placement(SPEC, tiny_host, resident).on_disk


def test_optimizer_state_goes_to_disk_last_pack_first():
    placement = disk_placement(SPEC, server(host_for(SPEC, PLAN)), PLAN)
    assert placement.on_disk == tuple((q, "optimizer") for q in range(5, -1, -1))
    # a pack out saves 8 MB, but staging three packs costs 24 MB: it takes four
    fewer = disk_placement(SPEC, server(host_for(SPEC, PLAN) + 16 * MB), PLAN)
    assert fewer.on_disk == tuple((q, "optimizer") for q in (5, 4, 3, 2))


# ---- the tasks ------------------------------------------------------------------------
def test_updates_read_ahead_and_write_behind():
    hw = server(host_for(SPEC, PLAN))
    graph = build_graph(SPEC, hw, PLAN)
    graph.check()
    assert graph.links[READ] == DISK[0] and graph.links[WRITE] == DISK[1]
    tasks = graph.tasks
    updates = sorted((t for t in tasks if t.kind == UPD), key=lambda t: t.seq)
    writes = []
    for u in updates:
        (read,) = [tasks[d] for d in u.deps if tasks[d].kind == DISK_IN]
        (write,) = [t for t in tasks if t.kind == DISK_OUT and u.id in t.deps]
        assert read.data == write.data == DiskState((u.pack,), ("optimizer",))
        assert read.nbytes == write.nbytes == 8 * MB
        assert (read.lane, write.lane, read.device) == (READ, WRITE, "host")
        # three packs staged: this read waits for the write three updates back, and
        # the two before it (updates may end out of order)
        j = len(writes)
        back = writes[max(0, j - 2 * STAGED_PACKS + 1) : max(0, j - STAGED_PACKS + 1)]
        assert [tasks[d] for d in read.deps] == back
        writes.append(write)
    trace = harmony.simulate(SPEC, hw, PLAN)
    tl = trace.timeline
    for k in range(1, 6):  # the update of pack k overlaps the read of pack k-1's state
        upd = tl[(tl.kind == UPD) & (tl.pack == k)].iloc[0]
        read = tl[(tl.kind == DISK_IN) & (tl.pack == k - 1)].iloc[0]
        assert read.start_s < upd.end_s and upd.start_s < read.end_s, k
    s = trace.summary
    assert s.disk_read_bytes == s.disk_write_bytes == 48 * MB
    assert s.swap_bytes == harmony.simulate(SPEC, simple_hardware(1), PLAN).summary.swap_bytes
    # disk-bound: the lower bound is the disk's reads (or writes) at its bandwidth
    assert s.lower_bound_by in (f"link:{READ}", f"link:{WRITE}")
    assert s.lower_bound_s == pytest.approx(48 * MB / DISK[0])
    assert s.to_dict()["disk_read_bytes"] == 48 * MB


def test_a_shared_disk_splits_its_time_between_reads_and_writes():
    """Where reads and writes share the disk's time, every disk transfer also
    crosses ``host.disk`` (capacity 1, a byte taking 1/bandwidth of it): the
    same tasks and bytes, but a read and a write at once each go at half speed
    (equal bandwidths), so the step is at least the sum of the disk's read and
    write times, which is then its lower bound."""
    host = host_for(SPEC, PLAN)
    duplex, shared = server(host), server(host, DISK + (True,))
    a, b = build_graph(SPEC, duplex, PLAN), build_graph(SPEC, shared, PLAN)
    b.check()
    disk = [t for t in b.tasks if t.kind in (DISK_IN, DISK_OUT)]
    assert disk and all(t.links[1:] == (SHARED,) for t in disk)
    assert all(t.link_costs() == (1.0, 1 / DISK[0]) for t in disk)
    assert b.links[SHARED] == 1.0 and SHARED not in a.links
    assert [(t.kind, t.nbytes, t.deps) for t in a.tasks] == [
        (t.kind, t.nbytes, t.deps) for t in b.tasks
    ]
    fast, slow = harmony.simulate(SPEC, duplex, PLAN), harmony.simulate(SPEC, shared, PLAN)
    assert slow.summary.bytes_by_kind == fast.summary.bytes_by_kind
    both = 48 * MB / DISK[0] + 48 * MB / DISK[1]
    assert slow.summary.lower_bound_by == f"link:{SHARED}"
    assert slow.summary.lower_bound_s == pytest.approx(both)
    assert fast.summary.lower_bound_s == pytest.approx(48 * MB / DISK[0])
    assert slow.iteration_s >= both > fast.iteration_s * 1.1
    # never two disk transfers at once faster than the disk's time allows
    tl = slow.timeline
    io = tl[tl.kind.isin([DISK_IN, DISK_OUT])]
    for _, row in io.iterrows():
        assert row.end_s - row.start_s >= row.bytes / DISK[0] * (1 - 1e-9)


def test_weight_loads_read_weights_on_disk_through_the_tier():
    # a little less memory than optimizer state alone on disk frees: weights go too,
    # and staging grows to 12 MB a pack, so four packs' weights must go
    hw = server(host_for(SPEC, PLAN) - 1)
    placement = disk_placement(SPEC, hw, PLAN)
    assert [q for q, k in placement.on_disk if k == "weights"] == [5, 4, 3, 2]
    assert placement.weights_with_update  # harmony-pp: each update follows its backward
    graph = build_graph(SPEC, hw, PLAN)
    graph.check()
    tasks = graph.tasks
    for load in (t for t in tasks if t.kind == W_IN):
        reads = [tasks[d] for d in load.deps if tasks[d].kind == DISK_IN]
        pack = load.layers[0]  # packs of one layer: the load's layer is its pack
        if pack < 2:
            assert reads == []
        elif "grads" in load.io:  # a backward load: its update's read, state and weights
            (read,) = reads
            assert read.data == DiskState((pack,), ("optimizer", "weights"))
            (update,) = [t for t in tasks if t.kind == UPD and t.pack == pack]
            assert read.id in update.deps and read.seq < load.seq
        else:  # a forward load reads the weights for itself
            assert [r.data for r in reads] == [DiskState((pack,), ("weights",), load=True)]
    s = harmony.simulate(SPEC, hw, PLAN).summary
    closed = swap_volume(SPEC, PLAN, hw)
    # the updates read and write all optimizer state and four packs' weights; the three
    # forward loads read those weights again, the four backward ones share the updates'
    assert closed[DISK_OUT] == s.disk_write_bytes == 48 * MB + 16 * MB
    assert closed[DISK_IN] == s.disk_read_bytes == 48 * MB + 16 * MB + 3 * 4 * MB
    # on two GPUs, where packs are in backward at once, every load reads for itself
    two = Plan.uniform("harmony-pp", 2, 4, 2, 6, 1)
    on_two = disk_placement(SPEC, server(host_for(SPEC, two) - 1, n_gpus=2), two)
    assert "weights" in {k for _, k in on_two.on_disk} and not on_two.weights_with_update
    with without_weights_with_update():  # every load reads for itself: four reads more
        apart = harmony.simulate(SPEC, hw, PLAN).summary
        assert swap_volume(SPEC, PLAN, hw)[DISK_IN] == apart.disk_read_bytes
        assert apart.disk_read_bytes == 48 * MB + 16 * MB + 7 * 4 * MB
        assert not disk_placement(SPEC, hw, PLAN).weights_with_update
    # a policy whose updates do not follow each pack's backward reads them for every load
    apart = Plan.uniform("harmony-no-grouping", 1, 4, 2, 6, 1)
    short = server(host_for(SPEC, apart) - 1)
    placed = disk_placement(SPEC, short, apart)
    on = {q for q, k in placed.on_disk if k == "weights"}
    assert on and not placed.weights_with_update
    # two microbatches, each loading the five forward packs and the six backward ones
    assert swap_volume(SPEC, apart)["W_IN"] == 2 * (5 + 6) * 4 * MB
    loaded = sum(1 for a, _ in apart.fwd_packs if a in on) + len(on)
    assert swap_volume(SPEC, apart, short)[DISK_IN] == pytest.approx(
        placed.read_bytes_per_step + 2 * loaded * 4 * MB
    )
    assert harmony.simulate(SPEC, short, apart).summary.disk_read_bytes == pytest.approx(
        swap_volume(SPEC, apart, short)[DISK_IN]
    )


def test_a_tied_parameter_is_read_from_its_owners_pack():
    layers = tuple(replace(c, param_numel=1_000_000) for c in SPEC.layers)
    tied = replace(SPEC, layers=layers, ties=(Tie(numel=500_000, layers=(0, 5)),))
    plan = PLAN
    # the least host memory: stashes, gradients (two packs' in slots, and the tied
    # parameter's for the whole step) and three packs staged, all else on disk
    state = [host_state(tied, range(*p)) for p in plan.bwd_packs]
    stash = swap_volume(tied, plan)["STASH_OUT"]
    staged = STAGED_PACKS * max(p.total - p.gradients for p in state)
    slots = 2 * max(p.gradients for p in state[1:]) + 500_000 * 4
    assert windowed_gradients(tied, plan) == slots
    least = stash + slots + staged
    hw = server(int(least))
    placement = disk_placement(tied, hw, plan)
    assert placement.where(0, "weights") == "disk" and placement.gradient_slots == 2
    # a byte less: the stashes go to disk too, and host memory holds a few of them
    assert disk_placement(tied, server(int(least) - 1), plan).stashes_on_disk
    in_flight = 2 * STASH_SLOTS * stash_piece_bytes(tied, plan)
    with pytest.raises(HostMemoryError, match="needs at least"):
        disk_placement(tied, server(int(least - stash + in_flight) - 1), plan)
    graph = build_graph(tied, hw, plan)
    fused = next(t for t in graph.tasks if t.kind == W_IN and t.layers == (5, 6))
    reads = [graph.tasks[d] for d in fused.deps if graph.tasks[d].kind == DISK_IN]
    # its own pack's weights from its update's read; the owner of its tied weight's
    # read for the load
    assert sorted((r.data.packs, r.data.load) for r in reads) == [((0,), True), ((5,), False)]
    s = harmony.simulate(tied, hw, plan).summary
    closed = swap_volume(tied, plan, hw)
    assert closed[DISK_IN] == pytest.approx(s.disk_read_bytes)


@pytest.mark.parametrize(
    "policy", ["harmony-dp", "zero-offload", "harmony-no-grouping", "karma", "hydra"]
)
def test_every_cpu_update_policy_gets_the_disk_tier(policy):
    n = 1 if policy == "hydra" else 2
    plan = Plan.uniform(policy, n, 4, 2, 6, 1)
    moved = swap_volume(SPEC, plan)
    # 96 MB of state, of which the gradients stay (24 MB, or two packs' 8 MB in slots
    # where the policy's gradients arrive pack after pack): two packs' optimizer state go
    window = gradient_window(policy)
    gradients = windowed_gradients(SPEC, plan) if window else 24 * MB
    hw = server(int(moved["STASH_OUT"] + moved["ACT_OUT"] + gradients + 56 * MB), n_gpus=n)
    graph = build_graph(SPEC, hw, plan)
    graph.check()
    placement = disk_placement(SPEC, hw, plan)
    assert placement.on_disk and placement.gradient_slots == (2 if window else 0)
    s = harmony.simulate(SPEC, hw, plan).summary
    closed = swap_volume(SPEC, plan, hw)
    assert s.disk_read_bytes == pytest.approx(closed[DISK_IN])
    assert s.disk_write_bytes == pytest.approx(closed[DISK_OUT])
    assert s.disk_write_bytes == pytest.approx(placement.write_bytes_per_step)


# ---- the search ---------------------------------------------------------------------
def test_the_search_pays_for_a_slow_disk_and_skips_plans_that_cannot_fit():
    roomy = simple_hardware(1, memory=40 * 10**6)  # GPUs that take packs of one layer
    fast = harmony.search(SPEC, roomy, 4, policies=["harmony-pp"], workers=1)
    slow_disk = replace(roomy, host_memory=host_for(SPEC, PLAN)).with_disk((20 * MB, 20 * MB))
    slow = harmony.search(SPEC, slow_disk, 4, policies=["harmony-pp"], workers=1)
    assert slow.iloc[0].iteration_s > fast.iloc[0].iteration_s
    assert slow.iloc[0].disk_gb > 0 and fast.iloc[0].disk_gb == 0
    # plans of larger packs stage more: they fit only with their stashes on disk too ...
    assert slow.attrs["rejected_host_memory"] == 0
    spilled = [disk_placement(SPEC, slow_disk, p).stashes_on_disk for p in slow.plan]
    assert any(spilled) and not all(spilled)
    # ... and with less host memory not even so: not returned
    tighter = harmony.search(
        SPEC, replace(slow_disk, host_memory=int(52 * MB)), 4, policies=["harmony-pp"], workers=1
    )
    assert tighter.attrs["rejected_host_memory"] > 0 and len(tighter)
    with pytest.raises(HostMemoryError, match="host memory"):
        harmony.search(SPEC, replace(roomy, host_memory=10), 4, policies=["harmony-pp"])


def test_the_search_cuts_packs_a_disk_tier_could_not_stage():
    """GPUs that take the whole chain in one pack, a host that stages three packs of
    one layer: the search cuts its packings until they can be staged (it found no
    plan before: its packs were cut by GPU memory alone)."""
    big_gpus = simple_hardware(1, memory=10**9)
    whole = harmony.search(SPEC, big_gpus, 4, policies=["harmony-pp"], workers=1)
    assert min(len(p.bwd_packs) for p in whole.plan) < len(SPEC)  # packs of many layers
    tight = replace(big_gpus, host_memory=host_for(SPEC, PLAN)).with_disk(DISK)
    df = harmony.search(SPEC, tight, 4, policies=["harmony-pp"], workers=1)
    assert len(df) and (df.disk_gb > 0).all()
    share = (tight.host_memory - host_state(SPEC, range(len(SPEC))).gradients) / STAGED_PACKS
    for plan in df.plan:
        for a, b in plan.bwd_packs:
            state = host_state(SPEC, range(a, b))
            assert state.weights + state.optimizer <= share or b - a == 1, plan.describe()


# ---- stashes on disk ----------------------------------------------------------------
# a minibatch of 16 one-sample microbatches: 4 layers x 16 MB of stashes, more than the
# state of the packs whose optimizer state the disk takes
STASHING = Plan.uniform("harmony-pp", 1, 16, 1, 6, 1)


def test_stashes_go_to_disk_last_and_come_back_ahead_of_backward():
    hw = server(int(80 * MB))
    stash = swap_volume(SPEC, STASHING)["STASH_OUT"]
    with_stashes = disk_placement(SPEC, server(int(120 * MB)), STASHING)
    assert with_stashes.on_disk and not with_stashes.stashes_on_disk  # state first
    placement = disk_placement(SPEC, hw, STASHING)
    assert placement.stashes_on_disk and placement.stash_disk_bytes == stash == 64 * MB
    piece = stash_piece_bytes(SPEC, STASHING)
    assert piece == 1 * MB  # one layer's input for one sample
    assert placement.reserve == windowed_gradients(SPEC, STASHING) + 2 * STASH_SLOTS * piece
    graph = build_graph(SPEC, hw, STASHING)
    graph.check()
    tasks = graph.tasks
    outs = sorted((t for t in tasks if t.kind == "STASH_OUT"), key=lambda t: t.seq)
    writes = {}
    for t in tasks:
        if t.kind == DISK_OUT and not isinstance(t.data, DiskState):
            (out,) = [tasks[d] for d in t.deps]
            assert out.kind == "STASH_OUT" and out.data == t.data and out.nbytes == t.nbytes
            writes[out.id] = t
    assert len(writes) == len(outs) == 4 * 16
    for j in range(STASH_SLOTS, len(outs)):  # a stash waits for the write two before it
        assert writes[outs[j - STASH_SLOTS].id].id in outs[j].deps
    backs = [t for t in tasks if t.kind == "STASH_IN" and t.data.layer > 0]
    for back in backs:
        (read,) = [tasks[d] for d in back.deps if tasks[d].kind == DISK_IN]
        assert read.data == back.data and read.nbytes == back.nbytes
        assert {d for d in read.deps if tasks[d].kind == DISK_OUT} == {
            writes[o.id].id
            for o in outs
            if o.data.layer == back.data.layer and o.data.samples == back.data.samples
        }
    # layer 0's stash is the minibatch, in host memory: nothing to read
    assert all(
        tasks[d].kind != DISK_IN
        for t in tasks
        if t.kind == "STASH_IN" and t.data.layer == 0
        for d in t.deps
    )
    trace = harmony.simulate(SPEC, hw, STASHING)
    s = trace.summary
    closed = swap_volume(SPEC, STASHING, hw)
    assert s.disk_read_bytes == pytest.approx(closed[DISK_IN])
    assert s.disk_write_bytes == pytest.approx(closed[DISK_OUT])
    assert s.disk_write_bytes == pytest.approx(placement.write_bytes_per_step)
    # played: never more than STASH_SLOTS stashes between their copy out and their write
    tl = trace.timeline
    held = [(tl.start_s[o.id], 1) for o in outs] + [(tl.end_s[w.id], -1) for w in writes.values()]
    level = peak = 0
    for _, step in sorted(held, key=lambda x: (x[0], x[1])):
        level += step
        peak = max(peak, level)
    assert peak == STASH_SLOTS
    # it costs time: the disk's reads and writes of the stashes
    assert (
        s.iteration_s > harmony.simulate(SPEC, server(int(120 * MB)), STASHING).summary.iteration_s
    )


def test_a_stash_read_back_in_smaller_microbatches_reads_its_samples():
    plan = Plan.uniform("harmony-pp", 1, 16, 1, 6, 1, fwd_microbatch=2)
    hw = server(int(80 * MB))
    graph = build_graph(SPEC, hw, plan)
    tasks = graph.tasks
    reads = [t for t in tasks if t.kind == DISK_IN and not isinstance(t.data, DiskState)]
    for read in reads:
        a, b = read.data.samples
        assert b - a == 1 and read.nbytes == 1 * MB
        (write,) = [tasks[d] for d in read.deps if tasks[d].kind == DISK_OUT]
        assert write.data.samples == (a - a % 2, a - a % 2 + 2)  # the forward's pair
    s = harmony.simulate(SPEC, hw, plan).summary
    assert s.disk_read_bytes == pytest.approx(swap_volume(SPEC, plan, hw)[DISK_IN])


# resident keeps its state on the GPU and has no disk tier (tests/test_resident.py)
@pytest.mark.parametrize("policy", sorted(set(harmony.POLICIES) - {"resident"}))
def test_every_policy_can_put_its_stashes_on_disk(policy):
    n = 1 if policy == "hydra" else 2
    plan = Plan.uniform(policy, n, 16, 1, 6, 1)
    hw = server(int(80 * MB), n_gpus=n)
    placement = disk_placement(SPEC, hw, plan)
    graph = build_graph(SPEC, hw, plan)
    graph.check()
    s = harmony.simulate(SPEC, hw, plan).summary
    closed = swap_volume(SPEC, plan, hw)
    assert s.disk_read_bytes == pytest.approx(closed[DISK_IN])
    assert s.disk_write_bytes == pytest.approx(closed[DISK_OUT])
    moved = swap_volume(SPEC, plan)
    stash = moved.get("STASH_OUT", 0) + moved.get("ACT_OUT", 0)
    # model-parallel keeps its state on its GPUs: its stashes fit beside the rest
    assert placement.stashes_on_disk == (policy != "model-parallel")
    if placement.stashes_on_disk:
        assert placement.stash_disk_bytes == stash
