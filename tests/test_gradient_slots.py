"""Gradients held in pack-sized slots where host memory is short: the placement
chooses them only where the whole model's gradients do not fit beside the
state, only for policies whose packs' gradients arrive pack after pack; the
graph makes each pack's gradients wait for the update two packs before it,
which keeps it free of deadlock (priorities) for every plan; the engine is
bitwise the run with the whole model's gradients, a tied GPT-2 included."""

from __future__ import annotations

from dataclasses import replace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW, Plan
from harmony.costs.catalog import model_spec
from harmony.costs.hardware import preset
from harmony.costs.placement import GRADIENT_SLOTS, HostMemoryError
from harmony.costs.spec import Tie
from harmony.graph import G_OUT, UPD, Gradients
from harmony.policies import build_graph, disk_placement, swap_volume
from harmony.policies.disk_tier import windowed_gradients
from harmony.policies.state import host_state
from harmony.simulate import simulate_graph

WINDOWED = ("harmony-pp", "harmony-dp", "hydra")
GiB = 2**30


def whole_gradients(spec, plan) -> int:
    return sum(host_state(spec, range(*p)).gradients for p in plan.bwd_packs)


def between(spec, plan, n_gpus: int = 1):
    """A host memory where the state fits with the gradients in slots, not with the
    whole model's: halfway between the two."""
    state = sum(host_state(spec, range(*p)).total for p in plan.bwd_packs)
    moved = swap_volume(spec, plan)
    stash = moved.get("STASH_OUT", 0.0) + moved.get("ACT_OUT", 0.0)
    whole, slots = whole_gradients(spec, plan), windowed_gradients(spec, plan)
    return int(state + stash - (whole - slots) / 2)


def windows_of(graph) -> list[tuple[list, list]]:
    """Per pack in the order its gradients arrive: (its G_OUTs, its updates)."""
    outs, order = {}, []
    for t in sorted(graph.tasks, key=lambda t: t.seq):
        if t.kind == G_OUT and isinstance(t.data, Gradients):
            if t.pack not in outs:
                order.append(t.pack)
            outs.setdefault(t.pack, []).append(t)
    updates = {q: [t for t in graph.tasks if t.kind == UPD and t.pack == q] for q in order}
    return [(outs[q], updates[q]) for q in order]


def test_gpt2_xl_fits_24_gib_with_its_gradients_in_slots():
    spec = model_spec("gpt2-xl")
    plan = Plan.uniform("harmony-pp", 4, 32, 2, len(spec), 4)
    hw = preset("paper-4x1080ti").with_host_memory("24GiB")
    placement = disk_placement(spec, hw, plan)
    assert placement.gradient_slots == GRADIENT_SLOTS and not placement.on_disk
    # 6.2 GB of gradients for the whole model, two packs' in slots
    assert whole_gradients(spec, plan) > 6e9 and placement.reserve < 24 * GiB
    graph = build_graph(spec, hw, plan)
    windows = windows_of(graph)
    for j, (outs, _) in enumerate(windows):
        waits = {u.id for u in windows[j - GRADIENT_SLOTS][1]} if j >= GRADIENT_SLOTS else set()
        for out in outs:
            assert waits <= set(out.deps)
    assert simulate_graph(graph).summary.iteration_s > 0
    # no slots where the whole model's gradients fit: the graph is the one it always was
    roomy = build_graph(spec, preset("paper-4x1080ti").with_host_memory("64GiB"), plan)
    assert "disk" not in roomy.info and len(roomy.tasks) == len(graph.tasks)
    # a policy whose packs' gradients build up together needs them all
    ablation = Plan.uniform("harmony-no-grouping", 4, 32, 2, len(spec), 4)
    with pytest.raises(HostMemoryError, match="give the server a disk tier"):
        disk_placement(spec, hw, ablation)


def test_ties_across_packs_keep_their_gradient_for_the_step():
    base = model_spec("gpt2-tiny")  # its head tied to its embedding, as GPT-2's is
    n = len(base)
    head = base.layers[n - 2]
    spec = replace(base, ties=(Tie((0, n - 2), head.param_numel),))
    one = Plan.uniform("harmony-pp", 1, 8, 8, n, 1)  # one pack per layer
    tie = spec.ties[0]
    master = 4
    per_pack = [host_state(spec, range(*p)).gradients for p in one.bwd_packs]
    owner = next(q for q, (a, b) in enumerate(one.bwd_packs) if a <= tie.layers[0] < b)
    per_pack[owner] -= tie.numel * master
    # two neighbouring packs' at once (their gradients arrive one pack after the other)
    neighbours = max(a + b for a, b in zip(per_pack, per_pack[1:]))
    assert windowed_gradients(spec, one) == neighbours + tie.numel * master
    whole = Plan.uniform("harmony-pp", 1, 8, 8, n, n)  # one pack: the tie is inside it
    assert windowed_gradients(spec, whole) == whole_gradients(spec, whole)


@st.composite
def plans(draw):
    policy = draw(st.sampled_from(WINDOWED + ("harmony-no-grouping", "karma", "zero-offload")))
    name = draw(st.sampled_from(["bert-large", "gpt2-medium"]))
    n = len(model_spec(name))
    gpus = 1 if policy == "hydra" else draw(st.sampled_from([1, 2, 4]))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=2, max_size=8)))
    bounds = [0, *cuts, n]
    bwd = tuple(zip(bounds, bounds[1:]))
    micro = draw(st.sampled_from([1, 2, 4]))
    return name, Plan(policy, gpus, 8 * gpus, micro, micro, bwd[:-1], bwd)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.sampled_from([False, True]))
def test_the_window_never_deadlocks_and_the_closed_form_agrees(case, disk):
    name, plan = case
    spec = model_spec(name)
    hw = (
        preset("paper-4x1080ti")
        .with_host_memory(between(spec, plan))
        .with_disk("nvme" if disk else None)
    )
    try:
        closed = disk_placement(spec, hw, plan)
        graph = build_graph(spec, hw, plan)
    except HostMemoryError:
        # the state fits beside two packs' gradients, not beside the whole model's
        assert plan.policy not in WINDOWED
        return
    except harmony.HarmonyError:  # a plan the policy cannot run (GPU memory, shapes)
        return
    placed = graph.info.get("disk")
    assert (placed or {}).get("gradient_slots", 0) == closed.gradient_slots
    saves = windowed_gradients(spec, plan) < whole_gradients(spec, plan)
    assert (closed.gradient_slots > 0) == (plan.policy in WINDOWED and saves)
    # priorities stay a topological order: the graph cannot deadlock
    for t in graph.tasks:
        assert all(graph.tasks[d].seq < t.seq for d in t.deps)
    assert simulate_graph(graph).summary.iteration_s > 0


# ---- the engine ---------------------------------------------------------------------
CFG = dict(n_layer=4, hidden=128, heads=2, seq_len=32, max_position=32, vocab=2000)


def tied_gpt2():
    from harmony.workbench.training import build_model

    model = build_model("gpt2-tiny", 0, dropout=0.0, **CFG)
    model[-1].lm_head.weight = model[0].wte.weight  # tied, as GPT-2's are
    return model


def train_gpt2(model, plan, device, steps: int = 3, **engine_kw) -> Engine:
    """``steps`` steps of ``model`` (a GPT-2 of ``CFG``) on one minibatch of 4 (seed 0)."""
    from harmony.workbench.training import lm_loss

    with torch.random.fork_rng():
        torch.manual_seed(0)
        (x,), y = harmony.zoo.example_input("gpt2-tiny", 4, **CFG)
    e = Engine(
        model,
        lambda ps: FlatAdamW(ps, lr=1e-3),
        lm_loss,
        device=device,
        hardware=device.hardware(),
        minibatch_size=4,
        plan=plan,
        **engine_kw,
    )
    for _ in range(steps):
        e.step(x, y)
    return e


def run_gpt2(host_memory, plan, monkeypatch) -> Engine:
    import harmony.engine.disk_setup as disk_setup
    import harmony.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "besides_the_model", lambda module: 0)
    monkeypatch.setattr(disk_setup, "device_memory_in_host", lambda *a: 0)
    device = EmulatedDevice("64MB", "4GB/s", "4GB/s")
    return train_gpt2(tied_gpt2(), plan, device, host_memory=host_memory, safe_updates=False)


def test_a_tied_gpt2_with_its_gradients_in_slots_is_exact(monkeypatch):
    """No disk tier: the state fits host memory once the gradients are in slots.
    The tied embedding's gradient sums the head's part and its own across the
    whole backward, outside the slots."""
    n = len(tied_gpt2())
    packs = tuple((i, i + 1) for i in range(n))
    plan = Plan("harmony-pp", 1, 4, 2, 2, packs[:-1], packs)  # two microbatches
    roomy = run_gpt2(None, plan, monkeypatch)
    try:
        assert roomy.gradient_slots is None
        expected = roomy.model_state_dict()
        spec = roomy.spec
    finally:
        roomy.close()
    assert spec.ties
    short = run_gpt2(between(spec, plan), plan, monkeypatch)
    try:
        slots = short.gradient_slots
        assert slots is not None and short.disk is None
        assert short.host.layout.allocated_bytes == 0  # no buffer for the whole model's
        assert slots.allocated_bytes == slots.nbytes == windowed_gradients(spec, plan)
        tie = spec.ties[0]
        assert slots.nbytes < whole_gradients(spec, plan) and tie.numel * 4 < slots.nbytes
        assert short.trace.summary.new_buffers == 0  # the slots are kept from step to step
        for name, value in short.model_state_dict().items():
            assert torch.equal(value, expected[name]), name
    finally:
        short.close()


@pytest.mark.heavy
def test_what_the_explorers_host_shares_put_on_disk_for_gpt2_xl():
    """The numbers PackExplorer's docstring gives for its host memory shares."""
    from harmony.planner import plan_for
    from harmony.workbench.tiers import host_memory_bytes

    spec, hw = model_spec("gpt2-xl"), preset("paper-4x1080ti")
    plan = plan_for("harmony-pp", spec, hw, 32)
    ablation = plan_for("harmony-no-grouping", spec, hw, 32)

    def on_disk(plan, share):
        server = hw.with_host_memory(host_memory_bytes(share, spec)).with_disk("nvme")
        kinds = [k for _, k in disk_placement(spec, server, plan).on_disk]
        return kinds.count("optimizer"), kinds.count("weights")

    assert len(plan.bwd_packs) == 20
    shares = {"90%": (5, 0), "75%": (11, 0), "60%": (18, 0), "45%": (20, 8)}
    assert {s: on_disk(plan, s) for s in shares} == shares
    assert on_disk(ablation, "60%")[0] > 0

    def stashes_on_disk(plan, share):
        server = hw.with_host_memory(host_memory_bytes(share, spec)).with_disk("nvme")
        return disk_placement(spec, server, plan).stashes_on_disk

    assert not stashes_on_disk(plan, "45%") and stashes_on_disk(plan, "30%")
    assert not stashes_on_disk(ablation, "60%") and stashes_on_disk(ablation, "50%")
    with pytest.raises(HostMemoryError, match="needs at least"):
        on_disk(ablation, "30%")
