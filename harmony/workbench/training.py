"""``harmony train``: train a zoo model with the engine on synthetic data, on one
server or (launched by torchrun) data parallel across several.

Synthetic minibatches are a pure function of (seed, step, rank), so a run is
reproducible and a distributed run can be replayed on one process over the
union of the servers' data.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..costs import zoo
from ..engine import EmulatedDevice, EmulatedServer, Engine, empty_weights, materialize
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


def empty_model(name: str, **overrides) -> nn.Sequential:
    """The zoo model without its loss layer, its parameters on the meta device
    (:func:`harmony.empty_weights`): an engine given ``init=zoo.layer_init(name)``
    makes them where they live; :func:`made_model` makes the same in memory."""
    with empty_weights():
        return nn.Sequential(*zoo.build(name, device="cpu", **overrides)[:-1])


def made_model(name: str, seed: int = 0, **overrides) -> nn.Sequential:
    """The weights :func:`train` makes on one server for ``seed``, in memory."""
    return materialize(empty_model(name, **overrides), zoo.layer_init(name), seed)


@dataclass
class HostOptions:
    """Host memory and the disk tier for :func:`train`: the process's budget
    (``memory``: bytes or ``"8GB"``; None: what the machine has), the tier's
    directory (``disk_dir``; default with a budget: ``disk-tier/`` in the run's
    checkpoint directory, else a temporary directory in the working directory,
    removed by :meth:`close`) and its link (``disk``: ``"R,W"`` paces it; None:
    measured)."""

    memory: str | int | None = None
    disk_dir: Path | None = None
    disk: str | None = None
    temporary: Path | None = None

    def engine_options(self, checkpoints: CheckpointDir | None) -> dict:
        """The Engine's ``host_memory``, ``disk_dir`` and ``disk``."""
        directory = self.disk_dir
        if directory is None and self.memory is not None:
            if checkpoints is not None:
                directory = checkpoints.directory / "disk-tier"
                directory.parent.mkdir(parents=True, exist_ok=True)
            else:
                self.temporary = Path(tempfile.mkdtemp(prefix=".harmony-disk-tier-", dir="."))
                directory = self.temporary / "tier"
        return dict(host_memory=self.memory, disk_dir=directory, disk=self.disk)

    def close(self) -> None:
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None


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
    host: HostOptions | None = None,
    **overrides,
) -> TrainResult:
    """Train ``name`` until ``steps`` synthetic minibatches (per server) are done.

    With ``checkpoints``, a checkpoint is written every ``checkpoint_every``
    steps and after the last; ``resume`` continues from the newest good one
    (the minibatches are a function of the step, so the run ends exactly as an
    uninterrupted one would). On one server the weights are made by the
    engine where they live (:func:`empty_model`; the values of
    :func:`made_model`), so a model larger than host memory is never built in
    it; across servers, rank 0's are broadcast. ``host``: the host memory budget and disk tier
    (:class:`HostOptions`); a checkpoint refers to the tier's state, which the
    tier keeps for its last two steps, so with a tier a checkpoint is written
    every step. Close the result's engine (and ``host``) when done."""
    options = _engine_options(host, checkpoints, checkpoint_every, resume)
    distributed = init_from_env(timeout_s)
    rank = torch.distributed.get_rank() if distributed else 0
    engine = _start_engine(
        name,
        minibatch,
        device,
        plan,
        lr,
        seed,
        distributed,
        options,
        overrides,
        precision=precision,
        nonfinite=nonfinite,
        checkpoints=checkpoints,
        resume=resume,
        log=log,
    )
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
                state = engine.state_dict(referenced=True)
                log(f"checkpoint {checkpoints.save(state, engine.step_count)}")
    rate = timed * minibatch / (time.perf_counter() - t0) if timed else float("nan")
    return TrainResult(losses, rate, engine)


def _engine_options(
    host: HostOptions | None,
    checkpoints: CheckpointDir | None,
    checkpoint_every: int,
    resume: bool,
) -> dict:
    """The engine's host memory and disk tier options, once the checkpointing asked
    for is known to work with them."""
    if checkpoint_every and checkpoints is None:
        raise HarmonyError("checkpoint_every needs a checkpoint directory (--checkpoint-dir)")
    if resume and checkpoints is None:
        raise HarmonyError("resume needs a checkpoint directory (--checkpoint-dir)")
    options = (host or HostOptions()).engine_options(checkpoints)
    if options["disk_dir"] is not None and checkpoints is not None and checkpoint_every > 1:
        raise HarmonyError(
            f"--checkpoint-every {checkpoint_every} with a disk tier: a checkpoint refers to "
            "the tier's state, which the tier keeps for its last two steps only; checkpoint "
            "every step (--checkpoint-every 1)"
        )
    return options


def _start_engine(
    name: str,
    minibatch: int,
    device,
    plan: Plan | str,
    lr: float,
    seed: int,
    distributed: bool,
    options: dict,
    overrides: dict,
    *,
    precision: str,
    nonfinite: str,
    checkpoints: CheckpointDir | None,
    resume: bool,
    log,
) -> Engine:
    """The engine for :func:`train`: the model's weights made where they live (one
    server) or built and broadcast (several), resumed from the newest good
    checkpoint when asked."""
    given = {k: v for k, v in options.items() if v is not None}  # else the checkpoint's
    if distributed:  # built on every server, rank 0's weights broadcast to the others
        model = build_model(name, seed, **overrides)
    else:  # made by the engine where they live (a model larger than host memory)
        model, given["init"] = empty_model(name, **overrides), zoo.layer_init(name)
    optimizer, loss_fn = (lambda ps: FlatAdamW(ps, lr=lr)), loss_for(name)
    common = dict(device=device, precision=precision, nonfinite=nonfinite, **given)
    found = checkpoints.latest(log) if resume else None
    if found and "disk" in found[1]:  # the run's state is partly on its tier
        path = found[0]
        given = plan if isinstance(plan, Plan) else None
        engine = Engine.load(path, model, optimizer, loss_fn, plan=given, **common)
    else:
        engine = Engine(
            model, optimizer, loss_fn, minibatch_size=minibatch, plan=plan, seed=seed, **common
        )
        if found:  # the checkpoint's plan, unless one was given
            engine.load_state_dict(found[1])
    if found:
        log(f"resumed from {found[0]} at step {engine.step_count}")
    elif resume:
        log(f"no checkpoint in {checkpoints.directory}: starting at step 0")
    return engine


def device_from_args(
    gpus: int, memory: str, h2d: str, d2h: str, uplink: str | None, p2p: str | None
):
    if gpus < 1:
        raise HarmonyError(f"--gpus must be >= 1, got {gpus}")
    if gpus == 1:
        return EmulatedDevice(memory=memory, h2d=h2d, d2h=d2h)
    return EmulatedServer(gpus=gpus, memory=memory, h2d=h2d, d2h=d2h, uplink=uplink, p2p=p2p)


def save_weights(engine: Engine, path: Path) -> None:
    """The final weights as a plain state_dict file, written atomically (master
    weights on a disk tier are read back into memory for it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(engine.model_state_dict(), tmp)
    tmp.replace(path)
