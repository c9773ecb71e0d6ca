"""The profiler's times per layer: every layer timed on a host (an emulated GPU);
on a GPU, the layers of one structure timed once, and the others take its times."""

from __future__ import annotations

import torch
from torch import nn

from harmony.engine import profiler


def chain() -> list[nn.Module]:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU())  # noqa: E731
    return [block(), block(), block(), nn.Linear(8, 3)]


def timed_layers(monkeypatch, once_per_structure: bool):
    calls = []

    def fake_time(layer, acts, *args):
        calls.append(layer)
        return ([len(calls)] * len(acts), [10 * len(calls)] * len(acts))

    monkeypatch.setattr(profiler, "_time_layer", fake_time)
    acts = {u: (torch.randn(u, 8),) for u in (1, 2)}
    times = profiler._time_layers(
        chain(),
        acts,
        torch.zeros(2, dtype=torch.long),
        nn.functional.cross_entropy,
        torch.device("cpu"),
        None,
        1,
        lambda: None,
        once_per_structure,
    )
    return times, calls


def test_on_a_host_every_layer_is_timed(monkeypatch):
    times, calls = timed_layers(monkeypatch, False)
    assert len(calls) == 4
    assert [t[0][0] for t in times] == [1, 2, 3, 4]


def test_on_a_gpu_the_layers_of_one_structure_take_the_times_of_the_first(monkeypatch):
    times, calls = timed_layers(monkeypatch, True)
    assert len(calls) == 2  # the three equal blocks once, the head once
    assert [t[0][0] for t in times] == [1, 1, 1, 2]
    assert times[0] == times[1] == times[2] != times[3]
