"""What the engine spends per compute task beyond the compute itself, measured:
:func:`measure_task_overhead` plays the steps of a tiny chain with the engine's
own pieces (its host model, a task graph, a step context, step runs)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..costs.hardware import Hardware
from ..plan import Plan
from ..policies import build_graph, update_shards
from ..simulate import play
from .context import StepContext
from .describe import describe_chain, norm_tensor_names
from .devices import make_backends
from .host_model import HostModel
from .journal import optimizer_kind
from .profiler import median_time
from .refusals import make_optimizers
from .step import StepRun

#: any server will do for eight tiny layers (a calibration must not calibrate itself)
_ANY_GPU = Hardware(
    name="any",
    n_gpus=1,
    gpu_memory=10**12,
    gpu_flops=1e12,
    h2d=1e10,
    d2h=1e10,
    uplink=1e10,
    gpus_per_switch=1,
    p2p=None,
    cpu_update_bandwidth=1e10,
    cpu_update_workers=1,
    host_memory=10**12,
)


def measure_task_overhead(device, repeats: int = 9) -> float:
    """Seconds the engine spends per GPU compute task beyond the compute itself,
    on ``device`` (anything :class:`~harmony.engine.Engine` accepts as one GPU):
    a chain of tiny layers with a pack per layer, step time over compute tasks.
    The simulator adds it to every compute task (``Hardware.task_overhead_s``).
    The steps run on this server alone, outside any process group, without
    safe updates, as an engine's steps run."""
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    packs = tuple((i, i + 1) for i in range(len(layers)))
    plan = Plan("harmony-pp", 1, 8, 2, 2, packs[:-1], packs)
    backends = make_backends(device)
    chain = list(layers)
    host = HostModel(chain, layers, pin=any(b.kind == "cuda" for b in backends))

    def factory(params):
        return torch.optim.SGD(params, lr=0.0)

    optimizers = make_optimizers(factory, host.update_params(plan, update_shards(plan)))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss_fn = nn.functional.mse_loss
    spec = describe_chain(
        chain, (x,), y, "Sequential", optimizer_kind(factory), loss_fn,
        backends[0].torch_device, None, plan,
    )  # fmt: skip
    graph = build_graph(spec, _ANY_GPU, plan)
    order = play(graph).order if any(b.copies for b in backends) else None
    rng_lock, steps = threading.Lock(), [0]
    norms = [norm_tensor_names(layer) for layer in chain]

    def step() -> None:
        ctx = StepContext(
            host, backends, plan, optimizers, loss_fn, "Sequential", None, norms, 1.0, 0,
            steps[0], rng_lock, None, None,
        )  # fmt: skip
        run = StepRun(ctx, graph, (x,), y, memory_order=order)
        run.execute()
        run.trace()  # as an engine step records it
        steps[0] += 1

    seconds = median_time(step, repeats)
    computes = sum(1 for t in graph.tasks if not t.is_transfer and t.kind != "UPD")
    return seconds / computes
