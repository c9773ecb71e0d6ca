"""Training state where the swapping baselines keep it: in (virtual) GPU memory.

A framework that virtualizes GPU memory (vDNN, IBM LMS, SwapAdvisor-style
swapping) keeps every tensor of training where PyTorch keeps it, on the GPU,
and swaps it to host memory and back. Harmony instead sums gradients and runs
the optimizer on the host. This module finishes a per-microbatch graph the
way the baselines treat that state, as the plan options say:

* gradients: each backward group (one pack on one microbatch) sends its
  gradient to host memory after its backward (G_OUT). With ``gpu_gradients``
  the sum lives on the GPU: every microbatch of a pack but a GPU's first
  brings the pack's accumulator back in before its backward (G_IN), and over
  several data-parallel GPUs the accumulators are all-reduced over the peer
  links after each GPU's last microbatch of the pack (REDUCE: a ring, each GPU
  sends 2(k-1)/k of it), as DistributedDataParallel does, before they go out;
* the update: with ``gpu_optimizer`` it runs on the GPU once backward is done,
  as ``optimizer.step()`` does: pack by pack in model order, the parameters,
  the gradient and the optimizer state come in (OPT_IN), the step runs on the
  GPU's compute lane, the updated parameters and state go back (OPT_OUT); the
  next pack's state is prefetched as weights are (``prefetch_packs``). Without
  it, each pack's CPU update starts once all of its gradients are in (Harmony's).

Host memory: with ``gpu_optimizer`` the state waits in host memory between
the GPU steps and never goes to a disk tier (the systems reproduced have none;
a plan whose state does not fit is refused, see :mod:`.disk_tier`); without
it, the CPU update reads what does not fit from the disk tier, as Harmony's.

Simplified: the accumulator and the state are swapped every time, as a fixed
schedule would, not only when memory runs short; parameters cross in the
spec's dtype (no float32 master copy on the GPU); the step streams its bytes
at :attr:`~harmony.costs.hardware.Hardware.gpu_update_bandwidth`.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec, dtype_bytes, state_slots
from ..graph import BWD, FWDBWD, G_IN, OPT_IN, OPT_OUT, REDUCE, W_IN, Gradients, Update
from ..plan import Plan
from .builder import BwdGroup, GraphBuilder
from .common import reuse_gradient_buffers
from .state import stepped_numel

#: the plan options this module reads
OPTIONS = ("gpu_optimizer", "gpu_gradients")


def update_bytes(spec: ModelSpec, layers: tuple[int, int]) -> tuple[float, float]:
    """(in, out) bytes of a pack's update on the GPU: its parameters, their
    gradient and the optimizer state come in; parameters and state go back."""
    n = stepped_numel(spec, *layers)
    params = n * dtype_bytes(spec.param_dtype)
    state = n * 4 * state_slots(spec.optimizer)
    return 2 * params + state, params + state


def gpu_update_seconds(spec: ModelSpec, layers: tuple[int, int], hw: Hardware) -> float:
    """A pack's optimizer step on a GPU of ``hw``: what it streams, at its
    :attr:`~harmony.costs.hardware.Hardware.gpu_update_bandwidth`."""
    slots = state_slots(spec.optimizer)
    return stepped_numel(spec, *layers) * 4 * (3 + 2 * slots) / hw.gpu_update_bandwidth


def accumulator_bytes(spec: ModelSpec, layers: tuple[int, int], split_ties: bool) -> float:
    """Bytes of a backward group's gradient buffer (what G_IN and REDUCE move):
    the pack's gradient less the tied parts that leave per microbatch."""
    split = spec.split_tie_bytes(*layers) if split_ties and spec.ties else 0
    return spec.grad_bytes(*layers) - split


def finish(b: GraphBuilder, update_gpus: dict[int, list[int]]) -> None:
    """Send every backward group's gradient out and run the updates, as the
    plan's ``gpu_gradients`` and ``gpu_optimizer`` say (see the module's
    docstring). ``update_gpus``: pack -> the GPUs that step it on the GPU
    (data parallel: every GPU with samples; a pipeline: the pack's stage)."""
    outs = gradients_out(b)
    if b.plan.option("gpu_optimizer"):
        update_on_gpus(b, outs, update_gpus)
    else:
        for pack, ids in sorted(outs.items(), reverse=True):
            b.update(pack, b.plan.bwd_packs[pack], ids, worker=pack)


def gradients_out(b: GraphBuilder) -> dict[int, list[int]]:
    """One G_OUT per backward group (with ``gpu_gradients``, G_IN before every
    group of a pack but a GPU's first, and a ring all-reduce across the GPUs
    after their last); returns pack -> the tasks its update waits for.
    Gradient buffers are reused as :func:`~.common.reuse_gradient_buffers` says."""
    on_gpu = b.plan.option("gpu_gradients")
    by_run: dict[tuple[int, int], list[BwdGroup]] = {}  # (gpu, pack) -> its groups in order
    for group in b.bwd_groups:
        by_run.setdefault((group.gpu, group.pack), []).append(group)
    reduces = _all_reduce(b, by_run) if on_gpu else {}
    loads = {t.io["grads"]: t.id for t in b.tasks if t.kind == W_IN and "grads" in t.io}
    outs: dict[int, list[int]] = {}
    drained: dict[int, list[int]] = {}
    for (gpu, pack), groups in by_run.items():
        earlier = None
        for group in groups:
            if on_gpu and earlier is not None:
                _accumulator_in(b, group, [earlier.id, loads[group.grad_buffer]])
            last = group is groups[-1]
            out = b.grad_out(group, deps=reduces.get(pack, []) if last else [])
            outs.setdefault(pack, []).append(out.id)
            # an accumulator waiting for the all-reduce (for GPUs further behind) does
            # not hold this GPU back: its next loads wait for its backward only
            drained[group.grad_buffer] = [group.ops[-1]] if last and pack in reduces else [out.id]
            earlier = out
    reuse_gradient_buffers(b, drained)
    for pack, ids in reduces.items():
        outs[pack] += ids
    return outs


def _accumulator_in(b: GraphBuilder, group: BwdGroup, after: list[int]) -> None:
    """The pack's accumulator comes back into ``group``'s gradient buffer, ``after``
    the previous group's has left and the buffer is there, before its backward
    adds this microbatch."""
    writers = [b.tasks[i] for i in group.ops if b.tasks[i].kind in (BWD, FWDBWD)]
    t = b.transfer(
        G_IN,
        f"gpu{group.gpu}.h2d",
        f"gpu{group.gpu}",
        b.h2d_route(group.gpu),
        b.buffers[group.grad_buffer].nbytes,
        after,
        f"gradient accumulator {group.layers}",
        for_op=writers[0].seq[0],
        data=Gradients(group.layers),
        pack=group.pack,
        layers=group.layers,
        microbatch=writers[0].microbatch,
    )
    t.io["grads"] = group.grad_buffer
    for w in writers:
        w.deps = sorted(set(w.deps) | {t.id})


def _all_reduce(
    b: GraphBuilder, by_run: dict[tuple[int, int], list[BwdGroup]]
) -> dict[int, list[int]]:
    """Per pack, over the GPUs that ran it (more than one), a ring all-reduce of
    their accumulators once each GPU's last group is done: pack -> the REDUCEs."""
    lasts: dict[int, list[BwdGroup]] = {}
    for (_, pack), groups in by_run.items():
        lasts.setdefault(pack, []).append(groups[-1])
    out: dict[int, list[int]] = {}
    for pack, groups in lasts.items():
        k = len(groups)
        if k < 2:
            continue
        done = [g.ops[-1] for g in groups]
        for i, g in enumerate(groups):
            route, rate = b.p2p_route(g.gpu, groups[(i + 1) % k].gpu)
            t = b.transfer(
                REDUCE,
                f"gpu{g.gpu}.p2p",
                f"gpu{g.gpu}",
                route,
                2 * (k - 1) / k * b.buffers[g.grad_buffer].nbytes,
                done,
                f"all-reduce gradients {g.layers}",
                max_rate=rate,
                pack=pack,
                layers=g.layers,
            )
            out.setdefault(pack, []).append(t.id)
    return out


def update_on_gpus(
    b: GraphBuilder, outs: dict[int, list[int]], update_gpus: dict[int, list[int]]
) -> None:
    """``optimizer.step()`` on each GPU once backward is done: per pack in model
    order, its state in (OPT_IN), the step on the GPU's compute lane, the state
    out (OPT_OUT); a GPU loads a pack's state once the state ``prefetch_packs``
    back has left. Every parameter is stepped by the replica of each GPU in
    ``update_gpus``; the update task of the r-th of k carries shard ``(r, k)``."""
    spec, window = b.spec, b.plan.option("prefetch_packs")
    after = max(t.seq[0] for t in b.tasks) + 1  # update steps come after every op
    left: dict[int, list[int]] = {}  # GPU -> its OPT_OUTs so far
    for pack, layers in enumerate(b.plan.bwd_packs):
        gpus = update_gpus[pack]
        for r, gpu in enumerate(gpus):
            dev, k = f"gpu{gpu}", after + pack * b.plan.n_gpus + r
            back = left.get(gpu, [])
            wait = [back[-window]] if len(back) >= window else []
            into, back_out = update_bytes(spec, layers)
            state = b.transfer(
                OPT_IN,
                f"{dev}.h2d",
                dev,
                b.h2d_route(gpu),
                into,
                outs[pack] + wait + b.tie_parts(layers),
                f"optimizer state {layers}",
                alloc_on=dev,
                for_op=k,
                data=Update(layers, (r, len(gpus))),
                pack=pack,
                layers=layers,
            )
            step = b.update(pack, layers, [state.id], worker=gpu, shard=(r, len(gpus)))
            # b.update makes a CPU step; this one runs on the GPU, in its lane's order
            step.lane, step.device, step.seq = f"{dev}.compute", dev, (k, 1, 0)
            step.duration = gpu_update_seconds(spec, layers, b.hw) + b.hw.task_overhead_s
            step.what = f"update {layers} on {dev}"
            out = b.transfer(
                OPT_OUT,
                f"{dev}.d2h",
                dev,
                b.d2h_route(gpu),
                back_out,
                [step.id],
                f"optimizer state {layers}",
                data=Update(layers, (r, len(gpus))),
                src=[state.io["dst"]],
                pack=pack,
                layers=layers,
            )
            left.setdefault(gpu, []).append(out.id)


def state_volume(
    spec: ModelSpec, plan: Plan, runs: dict[int, list[int]], split_ties: bool = True
) -> dict[str, float]:
    """Closed-form bytes of :func:`finish` beyond one G_OUT per group: ``runs``
    maps each pack to the number of its groups on each GPU that runs it (and
    steps it, with ``gpu_optimizer``); ``split_ties`` as the graph's builder."""
    out = {G_IN: 0.0, REDUCE: 0.0, OPT_IN: 0.0, OPT_OUT: 0.0}
    for pack, layers in enumerate(plan.bwd_packs):
        counts = runs[pack]
        acc = accumulator_bytes(spec, layers, split_ties)
        if plan.option("gpu_gradients"):
            out[G_IN] += sum(m - 1 for m in counts) * acc
            out[REDUCE] += 2 * (len(counts) - 1) * acc if len(counts) > 1 else 0.0
        if plan.option("gpu_optimizer"):
            into, back = update_bytes(spec, layers)
            out[OPT_IN] += len(counts) * into
            out[OPT_OUT] += len(counts) * back
    return out
