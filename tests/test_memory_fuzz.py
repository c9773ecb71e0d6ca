"""Plans the planner says fit never run out of memory in the engine: random
models (from blocks of several kinds) on random emulated devices, planned with
``plan="auto"``; whatever it picks trains with the simulated peak, within the
device, every time. ``bench/memory_fuzz.py`` runs many more."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import harmony
from harmony import EmulatedDevice, EmulatedServer, Engine, OutOfMemoryError, Plan
from harmony.plan import uniform_packs
from harmony.policies import resident
from harmony.simulate import simulate_graph
from harmony.testing import random_model

B = 8


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    gpus=st.sampled_from([1, 1, 2]),
    memory_kb=st.integers(40, 2000),
)
# plan="auto" once chose a data-parallel pack holding tied weights, which the engine refuses
@example(seed=0, gpus=2, memory_kb=1541)
def test_planner_chosen_plans_never_run_out_of_memory(seed, gpus, memory_kb):
    model, inputs, target, loss = random_model(seed, B)
    device = (
        EmulatedDevice(memory=f"{memory_kb}KB", h2d="2GB/s", d2h="2GB/s")
        if gpus == 1
        else EmulatedServer(gpus=gpus, memory=f"{memory_kb}KB", h2d="2GB/s", d2h="2GB/s")
    )
    engine = Engine(
        model, lambda ps: torch.optim.SGD(ps, lr=0.01), loss, device=device, minibatch_size=B
    )
    try:
        engine.step(inputs, target)
    except (
        OutOfMemoryError
    ) as err:  # the planner found nothing that fits: said before any task ran
        assert engine.plan is None, f"a chosen plan ran out of memory: {err}"
        event("no plan fits")
        return
    event(f"trained on {gpus} GPU(s)")
    engine.step(inputs, target)
    s = engine.trace.summary
    for gpu, peak in s.peak_memory.items():
        assert peak <= device.hardware().gpu_memory
        assert s.undeclared_bytes[gpu] == 0


def _skip_cnn(seed: int):
    """A random residual CNN with BatchNorm whose blocks are layers of the chain,
    the skip passed along beside the main path (seed 15: two such blocks)."""
    model, inputs, target, loss = random_model(seed, B)
    assert any(type(layer).__name__ == "_Fork" for layer in model)
    return model, inputs, target, loss


@pytest.mark.parametrize(
    "gpus, pack",
    [(1, None), (1, 1), (2, 1), (2, 3)],
    ids=["fused-1gpu", "per-layer-1gpu", "per-layer-2gpu", "packs-of-3-2gpu"],
)
def test_a_skip_across_packs_is_held_as_declared(gpus, pack):
    """Each compute task holds exactly the working memory its spec declares (a
    tensor the skip hands past several layers is one tensor), so the measured
    peak is the simulated one, every step."""
    model, inputs, target, loss = _skip_cnn(15)
    L = len(harmony.decompose(model))
    bwd = uniform_packs(0, L, pack or L)
    fwd = uniform_packs(0, bwd[-1][0], pack) if pack else ()
    device = (
        EmulatedDevice(memory="8MB", h2d="4GB/s", d2h="4GB/s")
        if gpus == 1
        else EmulatedServer(gpus=gpus, memory="8MB", h2d="4GB/s", d2h="4GB/s", p2p="4GB/s")
    )
    engine = Engine(
        model,
        lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss,
        device=device,
        minibatch_size=B,
        plan=Plan("harmony-pp", gpus, B, 2, 2, fwd, bwd),
    )
    for _ in range(2):
        engine.step(inputs, target)
        s = engine.trace.summary
        simulated = simulate_graph(engine._graph_cache).summary.peak_memory
        for gpu, peak in s.peak_memory.items():
            assert peak == pytest.approx(simulated[gpu], rel=1e-9), gpu
            assert s.undeclared_bytes[gpu] == 0, f"{gpu}: the spec undercounts"
            assert s.unheld_work_bytes[gpu] == 0, f"{gpu}: the spec overcounts"


# 0 and 9: tied-head language models; 1: an MLP with BatchNorm; 3: a residual CNN with
# its skip beside the main path; 5: a transformer
@pytest.mark.parametrize("seed", [0, 1, 3, 5, 9])
def test_a_resident_plan_at_capacity_holds_only_what_it_declares(seed):
    """A resident plan on an emulated GPU of exactly its simulated peak trains, holding
    no byte its plan does not declare (a weight several layers share is held once: a
    tied head's embedding was once counted twice, and such a plan ran out)."""
    model, inputs, target, loss = random_model(seed, B)
    plan = resident.plan_for(len(harmony.decompose(model)), B, B // 2)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.01)  # noqa: E731
    roomy = Engine(
        model, sgd, loss, device=EmulatedDevice(memory="8MB"), minibatch_size=B, plan=plan
    )
    roomy.step(inputs, target)
    peak = roomy.simulate().summary.peak_memory["gpu0"]
    model, inputs, target, loss = random_model(seed, B)
    device = EmulatedDevice(memory=int(peak))
    engine = Engine(model, sgd, loss, device=device, minibatch_size=B, plan=plan)
    for _ in range(2):
        engine.step(inputs, target)
        s = engine.trace.summary
        assert s.undeclared_bytes["gpu0"] == 0
        assert s.peak_memory["gpu0"] == peak
