"""Resident plans: the whole training state on the GPU, as the plain loop keeps it.
The engine trains bitwise like the plain loop, moves nothing over the links,
peaks where the simulator says; the search and plan="auto" pick it where it
fits and never where it does not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import ADAMW, B, batches, loss_fn, make_model, reference

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW, HarmonyError, Plan
from harmony.costs.placement import HostMemoryError
from harmony.graph import G_OUT, W_IN
from harmony.policies import resident
from harmony.workbench.training import build_model, lm_loss

ROOMY = EmulatedDevice(memory="64MB", h2d="400MB/s", d2h="400MB/s")
FLAT = lambda ps: FlatAdamW(ps, lr=1e-2)  # noqa: E731


def plan(microbatch: int = 4, **options) -> Plan:
    return resident.plan_for(9, B, microbatch, **options)


@pytest.mark.parametrize(
    "device, optimizer", [("cpu", ADAMW), (ROOMY, FLAT)], ids=["cpu-adamw", "emulated-flat"]
)
def test_a_resident_plan_trains_bitwise_like_the_plain_loop(device, optimizer):
    data = batches(3)
    expected, ref_losses = reference(optimizer, data, microbatch=4)
    model = make_model()  # with dropout and BatchNorm
    engine = Engine(model, optimizer, loss_fn, device=device, minibatch_size=B, plan=plan())
    losses = [engine.step(x, y) for x, y in data]
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), expected.buffers()))


def test_nothing_crosses_and_the_peak_is_the_simulated_one():
    data = batches(2)
    engine = Engine(make_model(), ADAMW, loss_fn, device=ROOMY, minibatch_size=B, plan=plan())
    for x, y in data:
        engine.step(x, y)
    measured, simulated = engine.trace.summary, engine.simulate().summary
    closed = harmony.swap_volume(engine.spec, engine.plan)
    assert closed[W_IN] == closed[G_OUT] == 0
    for kind, want in closed.items():
        assert measured.bytes_by_kind.get(kind, 0.0) == pytest.approx(want), kind
        assert simulated.bytes_by_kind.get(kind, 0.0) == pytest.approx(want), kind
    assert measured.peak_memory == simulated.peak_memory
    # weights, gradients and AdamW's two moments held on the device at the peak
    state = 4 * sum(p.numel() * 4 for p in engine.model.parameters())
    assert simulated.peak_memory["gpu0"] >= state


def test_mixed_precision_resident_equals_the_one_pack_harmony_plan():
    """Under bf16, the copies cast on the GPU and their sums cast back are the
    arithmetic harmony-pp does over the links: the same weights, bit for bit."""
    name, mb = "gpt2-tiny", 4
    (x,), y = harmony.zoo.example_input(name, mb)
    runs = []
    for policy in ("harmony-pp", "resident"):
        model = build_model(name, 0, dropout=0.0)
        n = len(harmony.decompose(model))
        p = Plan(policy, 1, mb, 2, 2, (), ((0, n),))
        engine = Engine(
            model, FLAT, lm_loss, device=ROOMY, minibatch_size=mb, plan=p, precision="bf16"
        )
        losses = [engine.step(x, y) for _ in range(2)]
        runs.append((losses, [t.detach().clone() for t in model.parameters()]))
    (l0, w0), (l1, w1) = runs
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_auto_picks_resident_where_it_fits_and_not_where_it_does_not():
    data = batches(2)
    # slow links: what a swap costs stands out of the noise of the profile's timings
    slow = EmulatedDevice(memory="64MB", h2d="2MB/s", d2h="2MB/s")
    roomy = Engine(make_model(), ADAMW, loss_fn, device=slow, minibatch_size=B)
    tight_device = EmulatedDevice(memory="40KB", h2d="400MB/s", d2h="400MB/s")
    tight = Engine(make_model(), ADAMW, loss_fn, device=tight_device, minibatch_size=B)
    for x, y in data:
        roomy.step(x, y)
        tight.step(x, y)
    assert roomy.plan.policy == "resident"
    state = 4 * sum(p.numel() * 4 for p in roomy.model.parameters())
    assert state > tight_device.capacity  # weights, gradients and AdamW state do not fit
    assert tight.plan.policy == "harmony-pp"
    assert tight.trace.summary.peak_memory["gpu0"] <= tight_device.capacity


def test_the_update_streams_at_the_hardware_gpu_update_bandwidth():
    spec = harmony.model_spec("gpt2-medium")
    hw = dataclasses.replace(harmony.preset("h100-pcie5"), task_overhead_s=0.0)
    p = resident.plan_for(len(spec), 8, 8)
    streamed = sum(layer.param_numel for layer in spec.layers) - sum(t.numel for t in spec.ties)
    for rate in (1e11, 1e12):
        graph = harmony.build_graph(spec, dataclasses.replace(hw, gpu_update_bandwidth=rate), p)
        (step,) = [t for t in graph.tasks if t.kind == "UPD"]
        # weights, gradient and Adam's two moments read; weights and moments written
        assert step.duration == pytest.approx(streamed * 4 * 7 / rate)


def test_the_search_rejects_resident_plans_over_the_gpu_memory():
    spec = harmony.model_spec("gpt2-medium")
    hw = harmony.preset("paper-4x1080ti")
    small = harmony.search(spec, hw, 8, policies=("harmony-pp", "resident"), n_gpus=1, workers=1)
    assert "resident" not in set(small["policy"])
    assert small.attrs["rejected_memory"] > 0
    large = dataclasses.replace(hw, gpu_memory=int(80e9))
    big = harmony.search(spec, large, 8, policies=("harmony-pp", "resident"), n_gpus=1, workers=1)
    assert big["policy"].iloc[0] == "resident"
    assert big["peak_memory_gb"].iloc[0] * 1e9 <= large.gpu_memory


def test_a_resident_plan_of_packs_or_gpus_is_refused():
    spec, hw = harmony.model_spec("gpt2-tiny"), harmony.preset("paper-4x1080ti")
    n = len(spec)
    for plan in (
        Plan("resident", 1, 8, 4, 4, ((0, 2),), ((0, 2), (2, n))),
        Plan("resident", 2, 8, 4, 4, (), ((0, n),)),
    ):
        with pytest.raises(HarmonyError, match="one backward pack of every layer"):
            harmony.build_graph(spec, hw, plan)
    with pytest.raises(HarmonyError, match="one microbatch size"):
        harmony.build_graph(spec, hw, Plan("resident", 1, 8, 8, 4, (), ((0, n),)))


def test_a_resident_plan_whose_host_copy_does_not_fit_is_a_host_memory_error():
    """The search and plan="auto" pass a HostMemoryError by: they go on to other plans."""
    spec = harmony.model_spec("gpt2-medium")
    hw = dataclasses.replace(harmony.preset("paper-4x1080ti"), gpu_memory=int(80e9))
    short = hw.with_host_memory(int(1e9))  # the model's state alone is 5.7 GB
    with pytest.raises(HostMemoryError):
        harmony.build_graph(spec, short, resident.plan_for(len(spec), 8, 4))
