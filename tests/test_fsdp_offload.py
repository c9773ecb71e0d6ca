"""The FSDP2 + CPUOffloadPolicy baseline runs in bfloat16 (on the CPU over gloo
here): float32 master weights gathered in bf16, the forward under autocast."""

from __future__ import annotations

import copy

import pytest
import torch

import harmony
from harmony.workbench.experiments import gpt2_config
from harmony.workbench.training import build_model, lm_loss

fsdp = pytest.importorskip("torch.distributed.fsdp")
from harmony.workbench.fsdp_offload import FSDP2Offload, single_process_group  # noqa: E402


def test_fsdp2_with_cpu_offload_trains_in_bf16_from_float32_masters():
    cfg = gpt2_config(32, 2, 16, 100)
    model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", 4, **cfg)
    plain = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = lm_loss(plain(x), y).item()
    cpu = torch.device("cpu")
    with single_process_group(cpu):
        system = FSDP2Offload(copy.deepcopy(model), lm_loss, 2, torch.bfloat16, cpu, lr=1e-3)
        losses = [system.step(x, y) for _ in range(3)]
        masters = [p.to_local() for p in system.model.parameters()]
    assert all(p.dtype == torch.float32 for p in masters)
    # bf16 weights in every layer (autocast keeps norms and embeddings in float32): close
    assert losses[0] == pytest.approx(first, rel=1e-2)
    assert losses[-1] < losses[0]
