"""The engine's ``host_memory`` is the whole process's budget: what the process
holds besides the model and the device memory that is host memory come out of
it before the training state is placed, the ledger charges them, and the
process's peak resident memory stays under the budget."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from harmony import EmulatedDevice, Engine, FlatAdamW, Plan
from harmony.costs.placement import HostMemoryError
from harmony.engine.host_memory import (
    EMULATED_SLACK,
    besides_the_model,
    device_memory_in_host,
    host_bytes_needed,
    resident_bytes,
)

D, LAYERS, B = 256, 6, 8
BESIDES = "the process besides the model (interpreter, torch, data)"
DEVICE = "device memory that is host memory (cpu or emulated GPU)"


def one_pack_per_layer(layers: int, minibatch: int) -> Plan:
    packs = tuple((i, i + 1) for i in range(layers))
    return Plan("harmony-pp", 1, minibatch, minibatch, minibatch, packs[:-1], packs)


def engine(host_memory, tier) -> Engine:
    torch.manual_seed(0)
    device = EmulatedDevice("64MB", "4GB/s", "4GB/s")
    return Engine(
        nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)]),
        lambda ps: FlatAdamW(ps, lr=1e-3),
        nn.functional.mse_loss,
        device=device,
        hardware=device.hardware(),
        minibatch_size=B,
        plan=one_pack_per_layer(LAYERS, B),
        host_memory=host_memory,
        disk_dir=tier,
        disk="4GB/s,4GB/s",
    )


def test_besides_the_model_is_resident_memory_less_the_model():
    model = nn.Linear(2048, 2048)  # 16.8 MB, written by its initialisation
    before = resident_bytes()
    besides = besides_the_model(model)
    after = resident_bytes()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert before - size <= besides <= after - size


def test_the_peak_resident_memory_can_start_anew():
    from harmony.engine.host_memory import peak_resident_bytes, reset_peak_resident

    big = torch.ones(50_000_000)  # 200 MB, resident
    high = peak_resident_bytes()
    del big
    assert reset_peak_resident()
    assert peak_resident_bytes() < high - 150e6


def test_a_flattened_model_counts_once():
    """The engine lays weights out in a few flat buffers: every parameter is a view
    of one, and the buffer counts once (it counted once per view)."""
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    plan = one_pack_per_layer(8, B)
    Engine(model, lambda ps: FlatAdamW(ps), nn.functional.mse_loss, minibatch_size=B, plan=plan)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    before = resident_bytes()
    besides = besides_the_model(model)
    after = resident_bytes()
    assert before - size <= besides <= after - size


def test_an_emulated_gpu_takes_at_most_its_capacity_and_a_tenth_of_host_memory():
    """What the host-memory accounting charges for an emulated GPU whose plan copies
    several times its capacity in a step (each pack's weights in, forward and
    backward): its peak, not one buffer per copy (it charged 3.6 GB for a 700 MB
    GPU training GPT-2 medium)."""
    layers, width = 12, 512
    torch.manual_seed(0)
    device = EmulatedDevice("8MB", "4GB/s", "4GB/s")
    e = Engine(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]),
        lambda ps: FlatAdamW(ps, lr=1e-3),
        nn.functional.mse_loss,
        device=device,
        minibatch_size=B,
        plan=one_pack_per_layer(layers, B),
    )
    e.step(torch.randn(B, width), torch.randn(B, width))
    graph, capacity = e._graph_cache, device.capacity
    moved = graph.bytes_by_kind()
    assert moved["W_IN"] > 2 * capacity  # what a pool per copy would have kept
    charged = device_memory_in_host(e.backends, graph)
    assert e.trace.summary.peak_memory["gpu0"] <= charged <= 1.1 * capacity
    assert host_bytes_needed(e.kept_on_host(), graph)["emulated GPU memory"] == charged


def test_what_the_process_holds_comes_out_of_the_budget(tmp_path):
    x, y = torch.randn(B, D), torch.randn(B, D)
    state = 16 * LAYERS * (D * D + D)  # weights, gradients, AdamW's two moments
    # room for the state beside what the process holds now and what setting up the
    # first step adds to it (torch's lazily made buffers): nothing needs the disk
    e = engine(resident_bytes() + 200 * 2**20 + 4 * state, tmp_path / "tier")
    try:
        e.step(x, y)
        assert e.disk is None
        outside = e.host_settings.outside
        assert outside[BESIDES] > 50e6  # the interpreter and torch, at least
        # an emulated GPU: its copies and computations, as much as its peak and a slack
        peak = e.simulate().summary.peak_memory["gpu0"]
        assert outside[DEVICE] == pytest.approx(peak * (1 + EMULATED_SLACK), rel=1e-6)
    finally:
        e.close()
    # a budget the process alone overflows: said before the first step, in words
    e = engine("10MB", tmp_path / "tier2")
    with pytest.raises(HostMemoryError, match="nothing is left for training state.*besides"):
        e.step(x, y)
    assert e.step_count == 0


SCRIPT = """
import json, sys, tempfile
import torch
from torch import nn
from harmony import EmulatedDevice, Engine, FlatAdamW
from harmony.engine.host_memory import peak_resident_bytes, resident_bytes
sys.path.insert(0, {tests!r})
from test_host_budget import one_pack_per_layer

torch.manual_seed(0)
width, layers, batch = 1024, 8, 8
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
x, y = torch.randn(batch, width), torch.randn(batch, width)
budget = resident_bytes() + {extra}
with tempfile.TemporaryDirectory(dir={tmp!r}) as d:
    e = Engine(model, lambda ps: FlatAdamW(ps, lr=1e-3), nn.functional.mse_loss, device="cpu",
               hardware=EmulatedDevice("1GB", "4GB/s", "4GB/s").hardware(),
               minibatch_size=batch, plan=one_pack_per_layer(layers, batch),
               host_memory=budget, disk_dir=d + "/tier", disk="2GB/s,2GB/s")
    del model
    for _ in range(4):
        e.step(x, y)
    peak = peak_resident_bytes()
    print(json.dumps(dict(budget=budget, peak=peak, ledger=e.host_settings.budget.peak,
                          on_disk=[list(k) for k in e.disk.placement.on_disk], charged=list(
                              e.host_settings.budget.allocations))))
    e.close()
"""


def test_peak_resident_memory_stays_under_the_budget(tmp_path):
    """A fresh process: its state (weights, gradients, AdamW: 134 MB) with 250 MB
    beside what it held at the start, on the cpu backend, whose computations take
    host memory too. The optimizer state goes to disk; the peak stays under."""
    from pathlib import Path

    code = SCRIPT.format(tests=str(Path(__file__).parent), extra=250 * 2**20, tmp=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(kind == "optimizer" for _, kind in got["on_disk"]), got
    assert BESIDES in got["charged"] and DEVICE in got["charged"]
    assert got["ledger"] <= got["budget"]
    assert got["peak"] <= got["budget"], (
        f"peak resident {got['peak'] / 1e6:.0f} MB over the budget {got['budget'] / 1e6:.0f} MB"
    )


def test_auto_plan_fits_what_the_budget_leaves(tmp_path, monkeypatch):
    """plan="auto" under 45 MB for a 33.6 MB state (weights, gradients, AdamW) beside
    an emulated GPU whose memory takes host memory (32 MB: too small for the plain
    loop, which would keep the whole state on it): the search cuts packs
    its disk tier can stage and searches again with what the devices leave (it
    planned for the whole budget before, and the engine then refused its plan).
    The run equals the same plan with everything in memory. (What the process holds
    besides the model is taken as 0 here: it varies with what ran before in it.)"""
    import harmony.engine.auto_plan as planning
    import harmony.engine.engine as engine_module

    width, layers, batch = 512, 8, 8

    def run(host_memory, plan, tier):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        device = EmulatedDevice("32MB", "4GB/s", "4GB/s")
        e = Engine(
            model,
            lambda ps: FlatAdamW(ps, lr=1e-3),
            nn.functional.mse_loss,
            device=device,
            hardware=device.hardware(),
            minibatch_size=batch,
            plan=plan,
            host_memory=host_memory,
            disk_dir=tier,
            disk=tier and "2GB/s,2GB/s",
        )
        torch.manual_seed(1)
        for _ in range(2):
            e.step(torch.randn(batch, width), torch.randn(batch, width))
        return e

    with monkeypatch.context() as m:
        m.setattr(engine_module, "besides_the_model", lambda module: 0)
        m.setattr(planning, "besides_the_model", lambda module: 0)
        # too little once the GPU's memory is out: said with what took the budget
        with pytest.raises(HostMemoryError, match="For the engine: its budget is 15 MB, less dev"):
            run("15MB", "auto", tmp_path / "small")
        auto = run("45MB", "auto", tmp_path / "tier")
    try:
        assert auto.disk is not None
        assert any(kind == "optimizer" for _, kind in auto.disk.placement.on_disk)
        assert auto.host_settings.outside[DEVICE] > 5e6
        budget = auto.host_settings.budget
        assert budget.peak <= budget.capacity
        weights = auto.model_state_dict()
        plan = auto.plan
    finally:
        auto.close()
    in_memory = run(None, plan, None)
    try:
        assert in_memory.disk is None
        for name, value in in_memory.model_state_dict().items():
            assert torch.equal(value, weights[name]), name
    finally:
        in_memory.close()


def test_auto_plan_with_tied_weights_on_disk_is_exact(tmp_path, monkeypatch):
    """A GPT-2 whose embedding is tied to its head, planned by plan="auto" under a
    budget that sends optimizer state and master weights to disk: bitwise equal
    to the same plan in host memory."""
    from test_gradient_slots import tied_gpt2, train_gpt2

    import harmony.engine.auto_plan as planning
    import harmony.engine.engine as engine_module

    def run(host_memory, plan, tier):
        device = EmulatedDevice("16MB", "4GB/s", "4GB/s")
        return train_gpt2(
            tied_gpt2(),
            plan,
            device,
            host_memory=host_memory,
            disk_dir=tier,
            disk=tier and "2GB/s,2GB/s",
        )

    with monkeypatch.context() as m:
        m.setattr(engine_module, "besides_the_model", lambda module: 0)
        m.setattr(planning, "besides_the_model", lambda module: 0)
        auto = run("20MB", "auto", tmp_path / "tier")
    try:
        assert {kind for _, kind in auto.disk.placement.on_disk} == {"optimizer", "weights"}
        weights, plan = auto.model_state_dict(), auto.plan
    finally:
        auto.close()
    in_memory = run(None, plan, None)
    try:
        for name, value in in_memory.model_state_dict().items():
            assert torch.equal(value, weights[name]), name
    finally:
        in_memory.close()
