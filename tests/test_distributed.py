"""Data parallel across servers: two gloo processes on this machine, each one
server with an emulated GPU, launched the way torchrun would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from harmony import Plan, reference_step
from harmony.policies.common import microbatches
from harmony.training import build_model, loss_for, synthetic_batch

MODEL, STEPS, B, LR = "gpt2-tiny", 3, 8, 1e-3
OVERRIDES = {"dropout": 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, rank: int, port: int, steps: int = STEPS, timeout: float = 30.0) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "harmony", "train", "--model", MODEL, "--steps", str(steps), "--minibatch", str(B),
           "--memory", "8MB", "--h2d", "1GB/s", "--d2h", "1GB/s", "--lr", str(LR), "--plan",
           str(tmp_path / "plan.json"), "--set", "dropout=0.0", "--save", str(tmp_path / f"rank{rank}.pt"),
           "--timeout", str(timeout)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write_plan(tmp_path, policy: str = "harmony-pp") -> Plan:
    plan = Plan(policy, 1, B, 4, 4, ((0, 2),), ((0, 2), (2, 5)))
    plan.to_json(tmp_path / "plan.json")
    return plan


@pytest.mark.parametrize("policy", ["harmony-pp", "karma"])  # KARMA: out-of-core, data parallel across servers
def test_two_servers_end_with_identical_weights_equal_to_one_process_over_all_data(tmp_path, policy):
    plan = write_plan(tmp_path, policy)
    port = free_port()
    procs = [launch(tmp_path, rank, port) for rank in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # bitwise identical across servers

    # one process over the union of both servers' minibatches, same microbatches
    model = build_model(MODEL, 0, **OVERRIDES)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    split = microbatches((0, B), plan.bwd_microbatch) + microbatches((B, 2 * B), plan.bwd_microbatch)
    for step in range(STEPS):
        parts = [synthetic_batch(MODEL, B, step, rank, 0, **OVERRIDES) for rank in (0, 1)]
        inputs = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
        target = torch.cat([p[1] for p in parts])
        reference_step(list(model), loss_for(MODEL), opt, inputs, target, None, step, microbatches=split)
    for k, v in model.state_dict().items():
        # AdamW normalises last-bit differences of near-zero gradients (the sums' order differs)
        torch.testing.assert_close(w0[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_a_server_that_dies_makes_the_other_fail_fast(tmp_path):
    write_plan(tmp_path)
    port = free_port()
    survivor = launch(tmp_path, 0, port, steps=1000, timeout=20.0)
    victim = launch(tmp_path, 1, port, steps=1000, timeout=20.0)
    while True:  # let both get through a step together (rank 0 logs its steps)
        line = survivor.stdout.readline()
        assert line, "the surviving server stopped before its first step"
        if line.startswith("step 1"):
            break
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    t0 = time.time()
    out, err = survivor.communicate(timeout=90)
    assert survivor.returncode != 0
    assert time.time() - t0 < 60
    lost = "another server stopped or timed out" in err or "Connection" in err or "timed out" in err.lower()
    assert lost, err[-2000:]
