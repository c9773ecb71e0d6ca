"""``harmony train``: train a zoo model with the engine on synthetic data, on one
server or (launched by torchrun) data parallel across several.

Synthetic minibatches are a pure function of (seed, step, rank), so a run is
reproducible and a distributed run can be replayed on one process over the
union of the servers' data.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..costs import zoo
from ..engine import EmulatedDevice, EmulatedServer, Engine
from ..engine.checkpoint import CheckpointDir
from ..engine.distributed import init_from_env
from ..engine.optim import FlatAdamW
from ..engine.reference_loop import layer_seed
from ..errors import HarmonyError
from ..plan import Plan


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run a block with ``n`` torch intra-op threads (None: leave as is). Toy
    layers run fastest on one thread, and the engine's lanes are threads too:
    more intra-op threads only oversubscribe a small CPU."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def loss_for(name: str):
    """Next-token loss for GPT-2, classification loss for the others."""
    return lm_loss if name.startswith("gpt2") else nn.functional.cross_entropy


def synthetic_batch(
    name: str, minibatch: int, step: int, rank: int = 0, seed: int = 0, **overrides
):
    """Random inputs and labels of the right kinds, the same for the same (seed, step, rank)."""
    with torch.random.fork_rng():
        torch.manual_seed(layer_seed(seed, step, rank, 7))
        return zoo.example_input(name, minibatch, **overrides)


def build_model(name: str, seed: int = 0, **overrides) -> nn.Sequential:
    """The zoo model on the CPU without its loss layer, initialised from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*zoo.build(name, device="cpu", **overrides)[:-1])


@dataclass
class TrainResult:
    losses: list[float]
    samples_per_s: float
    engine: Engine


def train(
    name: str,
    steps: int,
    minibatch: int,
    device,
    plan: Plan | str = "auto",
    lr: float = 1e-3,
    seed: int = 0,
    timeout_s: float = 60.0,
    log=print,
    checkpoints: CheckpointDir | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    precision: str = "fp32",
    nonfinite: str = "raise",
    **overrides,
) -> TrainResult:
    """Train ``name`` until ``steps`` synthetic minibatches (per server) are done.

    With ``checkpoints``, a checkpoint is written every ``checkpoint_every``
    steps and after the last; ``resume`` continues from the newest good one
    (the minibatches are a function of the step, so the run ends exactly as an
    uninterrupted one would)."""
    if checkpoint_every and checkpoints is None:
        raise HarmonyError("checkpoint_every needs a checkpoint directory (--checkpoint-dir)")
    if resume and checkpoints is None:
        raise HarmonyError("resume needs a checkpoint directory (--checkpoint-dir)")
    distributed = init_from_env(timeout_s)
    rank = torch.distributed.get_rank() if distributed else 0
    model = build_model(name, seed, **overrides)
    optimizer, loss_fn = (lambda ps: FlatAdamW(ps, lr=lr)), loss_for(name)
    engine = Engine(
        model,
        optimizer,
        loss_fn,
        device=device,
        minibatch_size=minibatch,
        plan=plan,
        seed=seed,
        precision=precision,
        nonfinite=nonfinite,
    )
    found = checkpoints.latest(log) if resume else None
    if found:  # the checkpoint's plan, unless one was given
        path, state = found
        engine.load_state_dict(state)
        log(f"resumed from {path} at step {engine.step_count}")
    elif resume:
        log(f"no checkpoint in {checkpoints.directory}: starting at step 0")
    losses, t0, timed = [], None, 0
    for step in range(engine.step_count, steps):
        inputs, target = synthetic_batch(name, minibatch, step, rank, seed, **overrides)
        loss = engine.step(inputs, target)
        if t0 is None:
            t0 = time.perf_counter()  # the first step profiles and plans
            if rank == 0:
                log(f"plan: {engine.plan.describe()}")
        else:
            timed += 1
        losses.append(loss)
        if rank == 0:
            log(f"step {step}: loss {loss:.6f}")
            if (
                checkpoints is not None
                and checkpoint_every
                and ((step + 1) % checkpoint_every == 0 or step + 1 == steps)
            ):
                log(f"checkpoint {checkpoints.save(engine.state_dict(), engine.step_count)}")
    rate = timed * minibatch / (time.perf_counter() - t0) if timed else float("nan")
    return TrainResult(losses, rate, engine)


def device_from_args(
    gpus: int, memory: str, h2d: str, d2h: str, uplink: str | None, p2p: str | None
):
    if gpus < 1:
        raise HarmonyError(f"--gpus must be >= 1, got {gpus}")
    if gpus == 1:
        return EmulatedDevice(memory=memory, h2d=h2d, d2h=d2h)
    return EmulatedServer(gpus=gpus, memory=memory, h2d=h2d, d2h=d2h, uplink=uplink, p2p=p2p)


def save_weights(engine: Engine, path: Path) -> None:
    """The final weights as a plain state_dict file, written atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({k: v.detach().clone() for k, v in engine.host_module.state_dict().items()}, tmp)
    tmp.replace(path)
