"""Data parallel across servers: two gloo processes on this machine, each one
server with an emulated GPU, launched the way torchrun would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

import harmony
from harmony import Plan, reference_step
from harmony.policies.common import microbatches
from harmony.workbench.training import build_model, loss_for, synthetic_batch

MODEL, STEPS, B, LR = "gpt2-tiny", 3, 8, 1e-3
OVERRIDES = {"dropout": 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    tmp_path, rank: int, port: int, steps: int = STEPS, timeout: float = 30.0
) -> subprocess.Popen:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "harmony",
        "train",
        "--model",
        MODEL,
        "--steps",
        str(steps),
        "--minibatch",
        str(B),
        "--memory",
        "8MB",
        "--h2d",
        "1GB/s",
        "--d2h",
        "1GB/s",
        "--lr",
        str(LR),
        "--plan",
        str(tmp_path / "plan.json"),
        "--set",
        "dropout=0.0",
        "--save",
        str(tmp_path / f"rank{rank}.pt"),
        "--timeout",
        str(timeout),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def write_plan(tmp_path, policy: str = "harmony-pp") -> Plan:
    plan = Plan(policy, 1, B, 4, 4, ((0, 2),), ((0, 2), (2, 5)))
    plan.to_json(tmp_path / "plan.json")
    return plan


# KARMA: out-of-core, data parallel across servers. Two server processes each: the
# second policy and the killed server run in `make heavy` (CI runs both).
@pytest.mark.parametrize("policy", ["harmony-pp", pytest.param("karma", marks=pytest.mark.heavy)])
def test_two_servers_end_with_identical_weights_equal_to_one_process_over_all_data(
    tmp_path, policy
):
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
    split = microbatches((0, B), plan.bwd_microbatch) + microbatches(
        (B, 2 * B), plan.bwd_microbatch
    )
    for step in range(STEPS):
        parts = [synthetic_batch(MODEL, B, step, rank, 0, **OVERRIDES) for rank in (0, 1)]
        inputs = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
        target = torch.cat([p[1] for p in parts])
        reference_step(
            list(model), loss_for(MODEL), opt, inputs, target, None, step, microbatches=split
        )
    for k, v in model.state_dict().items():
        # AdamW normalises last-bit differences of near-zero gradients (the sums' order differs)
        torch.testing.assert_close(w0[k], v, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.heavy
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
    out, err = survivor.communicate(timeout=300)  # a guard against a hang, not a measurement
    assert survivor.returncode != 0
    lost = (
        "another server stopped or timed out" in err
        or "Connection" in err
        or "timed out" in err.lower()
    )
    assert lost, err[-2000:]


NAN_ON_ONE_SERVER = """
import sys
import torch
import torch.distributed as dist
from harmony import EmulatedDevice, Engine, Plan
from harmony.engine.distributed import init_from_env

init_from_env(timeout_s=30.0)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                            torch.nn.Tanh(), torch.nn.Linear(16, 4))
plan = Plan("harmony-pp", 1, 8, 4, 4, ((0, 2), (2, 4)), ((0, 2), (2, 4), (4, 5)))
engine = Engine(model, lambda ps: torch.optim.SGD(ps, lr=0.1), torch.nn.functional.mse_loss,
                plan=plan, device=EmulatedDevice(memory="1MB", h2d="1GB/s", d2h="1GB/s"),
                minibatch_size=8, nonfinite="skip")
g = torch.Generator().manual_seed(rank)
losses = []
for step in range(4):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    if step == 1 and rank == 1:
        x[5, 0] = float("nan")  # a non-finite loss on this server only
    losses.append(engine.step(x, y))
torch.save({"weights": model.state_dict(), "skipped": engine.skipped_steps, "losses": losses},
           sys.argv[1])
"""


def test_a_non_finite_loss_on_one_server_makes_every_server_skip_that_step_at_once(tmp_path):
    script = tmp_path / "nan_on_one.py"
    script.write_text(NAN_ON_ONE_SERVER)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path / f"rank{rank}.pt")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]  # a guard against a hang
    for p, (_, err) in zip(procs, outs):
        # a server that waited for the other would have hit its 30 s timeout and failed
        assert p.returncode == 0, err[-2000:]
        assert "timed out" not in err.lower() and "timeout" not in err.lower(), err[-2000:]
    r0, r1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    assert r0["skipped"] == r1["skipped"] == 1
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    nan = [[x != x for x in r["losses"]] for r in (r0, r1)]
    assert nan == [[False, True, False, False]] * 2
    assert "the loss of samples" in outs[1][1] and "every server skips the step" in outs[1][1]


def test_gradients_in_one_run_of_memory_are_averaged_in_place_and_poison_spreads():
    import torch.distributed as dist

    from harmony.engine.distributed import GradientSync

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
        flat = torch.arange(7.0)
        # a pack's grads in the flat buffer
        params[0].grad, params[1].grad = flat[:3], flat[3:].view(2, 2)
        sync = GradientSync([(0, 0)])
        sync.start_step()
        with sync.update((0, 0)):
            sync.average((0, 0), params)
        assert params[0].grad.data_ptr() == flat.data_ptr() and torch.equal(
            flat, torch.arange(7.0)
        )
        # elsewhere in memory: through a gathered copy, same tensors
        params[1].grad = torch.ones(2, 2)
        before = params[1].grad
        sync.start_step()
        with sync.update((0, 0)):
            sync.average((0, 0), params, poison=True)
        assert (
            params[1].grad is before
            and torch.isnan(before).all()
            and torch.isnan(params[0].grad).all()
        )
        sync.start_step()
        with pytest.raises(RuntimeError), sync.update((0, 0)):  # a failed update ...
            raise RuntimeError("an update that fails")
        with pytest.raises(harmony.HarmonyError, match="an earlier update of this step failed"):
            with sync.update((0, 0)):  # ... and the step's later ones exchange nothing
                pass
    finally:
        dist.destroy_process_group()
