"""Calibration measures what it used to assume: the host's optimizer bandwidth
(a real FlatAdamW step), a device's (a fused AdamW step on it) and, on a GPU,
its matmul FLOP rate."""

from __future__ import annotations

import pytest
import torch

from harmony import EmulatedDevice
from harmony.engine import calibrate as calibration
from harmony.engine import rates


@pytest.fixture
def fresh_calibration():
    calibration._cpu_update_bandwidth.cache_clear()
    yield
    calibration._cpu_update_bandwidth.cache_clear()


def test_the_cpu_update_bandwidth_is_measured_not_assumed(monkeypatch, fresh_calibration):
    monkeypatch.setattr(rates, "cpu_update_bandwidth", lambda: 1.25e9)
    assert calibration.calibrate("cpu").cpu_update_bandwidth == 1.25e9
    device = EmulatedDevice(memory="8MB", h2d="100MB/s", d2h="100MB/s")
    assert calibration.calibrate(device).cpu_update_bandwidth == 1.25e9
    # the cpu and emulated backends run a GPU's update on this CPU: at the host's rate
    assert calibration.calibrate("cpu").gpu_update_bandwidth == 1.25e9
    assert calibration.calibrate(device).gpu_update_bandwidth == 1.25e9


def test_an_update_bandwidth_is_the_bytes_adamw_streams_over_the_median_step(monkeypatch):
    ticks = iter([0.0, 2.0, 10.0, 11.0, 20.0, 23.0])  # steps of 2, 1 and 3 s: median 2
    monkeypatch.setattr(rates.time, "perf_counter", lambda: next(ticks))
    numel = 1 << 10
    rate = rates.update_bandwidth(torch.device("cpu"), numel=numel, repeats=3)
    # weights, gradient and both moments read; weights and both moments written
    assert rate == numel * 4 * 7 / 2.0


def test_a_flat_adamw_step_and_a_matmul_give_positive_rates():
    assert rates.cpu_update_bandwidth(numel=1 << 12, repeats=1) > 0
    assert rates.update_bandwidth(torch.device("cpu"), numel=1 << 12, repeats=1) > 0
    assert rates.matmul_flops(torch.device("cpu"), torch.float32, 64, repeats=1) > 0
