"""Model parallelism: the layers split over the GPUs, weights resident (HYDRA's baseline).

The published baseline: HYDRA (Nagrecha & Kumar, 2021) measures model
spilling against plain model parallelism, as PyTorch runs a model whose
layers are placed on several GPUs: contiguous stages, one per GPU; each
(micro)batch goes forward through the stages one after the other and back,
so one GPU computes at a time (no pipelining); every stage keeps its layers'
weights, gradients and optimizer state on its GPU, nothing is swapped, and
the model must fit in the GPUs' memory together.

This policy: stages of contiguous backward packs, as even a number of packs
per GPU as possible, forward on the same boundaries
(:func:`~harmony.planner.systems.choose_model_parallel` makes one pack per
GPU, balanced by resident bytes); per microbatch, each pack forward on its
stage's GPU with activations GPU to GPU between stages, the last pack fused
with the loss and its backward, then backward through the packs in reverse;
each compute task waits for the one before it, whatever GPU it ran on (one
GPU at a time); a pack keeps its input on its GPU from its forward to its
backward, and its gradient accumulates there over the microbatches. With
``gpu_optimizer`` (the faithful plan) weights, gradients and optimizer state
are resident: nothing but the data crosses the host links, and each GPU
steps its packs once backward is done. Without it (what harmony's engine
runs, since its weights live on the host), each pack's weights come in once
at the start of the iteration and stay, its gradient goes out once, and the
CPU steps it.

With ``gpu_optimizer`` the host keeps none of the state, so host memory
never limits it; without it, state that does not fit host memory goes to the
disk tier as for every CPU update (:mod:`.disk_tier`).

Simplified: backward rebuilds a pack's activations from its input (the IR's
recompute; the reference profiles' backward time includes it), where plain
model parallelism keeps them; ``offload_activations``, ``prefetch_packs`` and
``gpu_gradients`` mean nothing here (nothing is swapped); a parameter tied
across packs keeps its parts in each pack's gradient, summed on the host.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.placement import Placement
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import (
    BWD,
    DATA_IN,
    FWD,
    FWDBWD,
    G_OUT,
    P2P,
    REC,
    W_IN,
    Activation,
    Batch,
    Task,
    TaskGraph,
    Weights,
)
from ..plan import Plan
from .builder import BwdGroup, GraphBuilder
from .common import check_one_microbatch_size, data_bytes, microbatches, replica_shares
from .swapping import gpu_update_seconds
from .tier_placement import disk_volume

NAME = "model-parallel"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
#: weights load once per iteration, not per microbatch
PER_MICROBATCH = False
#: plan options it reads beyond every policy's
OPTIONS = ("gpu_optimizer",)


def stages(plan: Plan) -> list[int]:
    """The GPU of each backward pack: contiguous runs, as even in number as
    possible; a HarmonyError for a plan this policy cannot run."""
    check_one_microbatch_size(plan)
    P, n = len(plan.bwd_packs), plan.n_gpus
    if P < n:
        raise HarmonyError(
            f"model-parallel puts whole backward packs on each GPU: {P} packs "
            f"cannot fill {n} GPUs; use at least {n} packs or fewer GPUs"
        )
    if plan.fwd_packs != plan.bwd_packs[:-1]:
        raise HarmonyError(
            "model-parallel runs forward on the backward packs: fwd_packs must be "
            f"bwd_packs without the fused last one, {list(plan.bwd_packs[:-1])}"
        )
    return [s for s, (a, b) in enumerate(replica_shares(P, n)) for _ in range(a, b)]


class _Schedule:
    """The graph of one iteration, built microbatch by microbatch."""

    def __init__(self, spec: ModelSpec, hw: Hardware, plan: Plan, model: int):
        self.b = GraphBuilder(spec, hw, plan, model, split_ties=False)
        self.spec, self.hw, self.plan = spec, hw, plan
        self.stage = stages(plan)
        self.resident = plan.option("gpu_optimizer")
        self.k = 0  # the place of the current compute op in the global order
        self.prev: Task | None = None  # the last compute task: the next one waits for it
        # pack -> its weights buffer, gradient buffer and load (None: resident)
        self.weights: dict[int, tuple[int, int | None, int | None]] = {}
        self.writers: dict[int, list[int]] = {}  # pack -> its tasks that add to its gradient

    def dev(self, pack: int) -> str:
        return f"gpu{self.stage[pack]}"

    def _pack_weights(self, pack: int) -> tuple[int, int | None, list[int], list[int]]:
        """The pack's buffers (weights, gradient; with ``gpu_optimizer`` one buffer
        of weights, gradient and optimizer state), the tasks to wait for, and
        the buffers the pack's first compute task allocates."""
        if pack in self.weights:
            w, g, load = self.weights[pack]
            return w, g, [load] if load is not None else [], []
        spec, dev, layers = self.spec, self.dev(pack), self.plan.bwd_packs[pack]
        if self.resident:  # there from earlier iterations: nothing crosses
            state = (
                spec.weight_bytes(*layers)
                + spec.grad_bytes(*layers)
                + spec.optimizer_state_bytes(*layers)
            )
            w = self.b.buffer(dev, state, f"resident state {layers}")
            self.weights[pack] = (w, None, None)
            return w, None, [], [w]
        t = self.b.transfer(
            W_IN,
            f"{dev}.h2d",
            dev,
            self.b.h2d_route(self.stage[pack]),
            spec.weight_bytes(*layers),
            [],
            f"weights {layers}",
            alloc_on=dev,
            for_op=self.k,
            data=Weights(layers),
            pack=pack,
            layers=layers,
        )
        w = t.io.pop("dst")
        g = self.b.buffer(dev, spec.grad_bytes(*layers), f"grads {layers}")
        t.allocs.append(g)
        t.io.update(weights=w, grads=g)
        self.weights[pack] = (w, g, t.id)
        return w, g, [t.id], []

    def compute(
        self,
        kind: str,
        pack: int,
        m: int,
        samples: tuple[int, int],
        deps: list[int],
        io: dict,
        work: float | None,
    ) -> Task:
        """A compute task of ``pack`` on microbatch ``m``, after the one before it
        (a BWD shares its REC's place in the order, as the builder's do)."""
        s, e = self.plan.bwd_packs[pack]
        a, c = samples
        if kind != BWD:
            self.k += 1
        w, g, wait, first = self._pack_weights(pack)
        io = {"weights": w, **io}
        if g is not None and kind in (BWD, FWDBWD):
            io["grads"] = g
        duration = self._seconds(kind, s, e, c - a)
        # the fixed cost once per pack and microbatch (on the task that starts it),
        # or on every task
        if kind != BWD or self.hw.overhead_per == "task":
            duration += self.hw.task_overhead_s
        chain = [self.prev.id] if self.prev is not None else []
        dev = self.dev(pack)
        t = Task(
            len(self.b.tasks),
            kind,
            f"{dev}.compute",
            dev,
            (self.k, 1, int(kind == BWD)),
            sorted(set(deps + wait + chain)),
            duration=duration,
            model=self.b.model,
            pack=pack,
            layers=(s, e),
            microbatch=m,
            samples=samples,
            io=io,
            what=f"{kind} layers {s}..{e - 1} samples {a}..{c - 1}",
        )
        self.b.tasks.append(t)
        t.allocs += first
        if work is not None:
            io["work"] = self.b.buffer(dev, work, f"working memory {kind} {(s, e)}")
            t.allocs.append(io["work"])
        if kind in (BWD, FWDBWD):
            self.writers.setdefault(pack, []).append(t.id)
        self.prev = t
        return t

    def _seconds(self, kind: str, s: int, e: int, n: int) -> float:
        """As the builder splits them: REC the forward time, BWD the rest."""
        spec, flops = self.spec, self.hw.gpu_flops
        if kind == FWD:
            return spec.fwd_time(s, e, n, flops)
        if kind == FWDBWD:
            return spec.bwd_time(s, e, n, flops)
        recompute = min(spec.fwd_time(s, e, n, flops), spec.bwd_time(s, e, n, flops))
        return recompute if kind == REC else spec.bwd_time(s, e, n, flops) - recompute

    def output(self, t: Task, layer: int, forward: bool) -> tuple[int, int] | None:
        """The buffer ``t`` makes for the next pack: the activations into ``layer``
        (forward) or their gradient (backward; none into layer 0), and ``t``."""
        n = t.samples[1] - t.samples[0]
        if not forward and layer == 0:
            return None
        size = self.spec.input_bytes if forward else self.spec.input_grad_bytes
        nbytes = size(layer, n)
        what = "activations" if forward else "gradient"
        buf = self.b.buffer(t.device, nbytes, f"{what} into layer {layer} {t.samples}", t.samples)
        t.allocs.append(buf)
        t.io["output"] = buf
        return buf, t.id

    def to(
        self, value: tuple[int, int], pack: int, data: Activation, nbytes: float
    ) -> tuple[int, int]:
        """``value`` (buffer, task) on the GPU of ``pack``: a P2P copy when it is
        elsewhere (the copy frees the source)."""
        buf, task = value
        src, dst = self.b.buffers[buf].device, self.dev(pack)
        if src == dst:
            return value
        route, rate = self.b.p2p_route(int(src[3:]), self.stage[pack])
        t = self.b.transfer(
            P2P,
            f"{dst}.p2p",
            dst,
            route,
            nbytes,
            [task],
            f"{data.what} layer {data.layer} {data.samples} from {src}",
            alloc_on=dst,
            max_rate=rate,
            for_op=self.k + 1,
            data=data,
            src=[buf],
            samples=data.samples,
        )
        return t.io["dst"], t.id

    def data_in(
        self, pack: int, what: str, samples: tuple[int, int], nbytes: float
    ) -> tuple[int, int]:
        dev = self.dev(pack)
        t = self.b.transfer(
            DATA_IN,
            f"{dev}.h2d",
            dev,
            self.b.h2d_route(self.stage[pack]),
            nbytes,
            [],
            f"{what} {samples}",
            alloc_on=dev,
            for_op=self.k + 1,
            data=Batch(what, samples),
            samples=samples,
        )
        return t.io["dst"], t.id

    def microbatch(self, m: int, samples: tuple[int, int]) -> None:
        spec, packs, b = self.spec, self.plan.bwd_packs, self.b
        n, last = samples[1] - samples[0], len(packs) - 1
        x = self.data_in(0, "inputs", samples, spec.input_bytes(0, n))
        kept: dict[int, int] = {}  # pack -> its input, kept on its GPU for its backward
        for q in range(last):
            s, e = packs[q]
            x = self.to(x, q, Activation("act", s, samples), spec.input_bytes(s, n))
            t = self.compute(
                FWD, q, m, samples, [x[1]], {"input": [x[0]]}, spec.fwd_work_bytes(s, e, n)
            )
            b.release(t, t.io["work"])
            kept[q] = x[0]
            x = self.output(t, e, forward=True)
        s, e = packs[last]
        x = self.to(x, last, Activation("act", s, samples), spec.input_bytes(s, n))
        y = self.data_in(last, "labels", samples, spec.target_bytes(n))
        t = self.compute(
            FWDBWD,
            last,
            m,
            samples,
            [x[1], y[1]],
            {"input": [x[0]], "labels": y[0]},
            spec.bwd_work_bytes(s, e, n),
        )
        for buf in (t.io["work"], x[0], y[0]):
            b.release(t, buf)
        grad = self.output(t, s, forward=False)
        for q in range(last - 1, -1, -1):
            s, e = packs[q]
            grad = self.to(grad, q, Activation("grad", e, samples), spec.input_grad_bytes(e, n))
            # the recompute waits for the output gradient, as autograd reaches the pack then
            rec = self.compute(
                REC,
                q,
                m,
                samples,
                [grad[1]],
                {"stash_in": [kept[q]]},
                spec.bwd_work_bytes(s, e, n),
            )
            t = self.compute(
                BWD, q, m, samples, [rec.id], {"saved": rec.io["work"], "grad_in": [grad[0]]}, None
            )
            for buf in (rec.io["work"], kept[q], grad[0]):
                b.release(t, buf)
            grad = self.output(t, s, forward=False)

    def finish(self) -> None:
        """Free each pack's weights after its last task; gradients out and CPU
        updates, or with ``gpu_optimizer`` each GPU's steps in model order."""
        b = self.b
        after = self.k + 1
        for q, layers in enumerate(self.plan.bwd_packs):
            w, g, _ = self.weights[q]
            last = b.tasks[self.writers[q][-1]]
            if self.resident:
                step = b.update(q, layers, [last.id], worker=self.stage[q])
                dev = self.dev(q)
                # b.update makes a CPU step; this one runs on the GPU, in its lane's order
                step.lane, step.device, step.seq = f"{dev}.compute", dev, (after + q, 1, 0)
                step.duration = (
                    gpu_update_seconds(self.spec, layers, self.hw) + self.hw.task_overhead_s
                )
                step.what = f"update {layers} on {dev}"
                b.release(step, w)
                continue
            b.release(last, w)
            out = b.grad_out(BwdGroup(self.stage[q], q, layers, list(self.writers[q]), g))
            b.update(q, layers, [out.id], worker=q)


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    sched = _Schedule(spec, hw, plan, model)
    for m, samples in enumerate(microbatches((0, plan.minibatch), plan.fwd_microbatch)):
        sched.microbatch(m, samples)
    sched.finish()
    return sched.b.graph(policy=NAME)


def swap_volume(spec: ModelSpec, plan: Plan, disk: Placement | None = None) -> dict[str, float]:
    stage = stages(plan)
    B, packs = plan.minibatch, plan.bwd_packs
    crossing = [packs[q][0] for q in range(1, len(packs)) if stage[q] != stage[q - 1]]
    moved = sum(spec.input_bytes(layer, B) + spec.input_grad_bytes(layer, B) for layer in crossing)
    loaded = 0.0 if plan.option("gpu_optimizer") else 1.0
    out = {
        W_IN: loaded * sum(spec.weight_bytes(*p) for p in packs),
        G_OUT: loaded * sum(spec.grad_bytes(*p) for p in packs),
        DATA_IN: data_bytes(spec, B),
        P2P: moved,
    }
    if disk is not None and disk.uses_disk:  # each pack's weights load once
        out.update(disk_volume(spec, plan, disk, [(p, loaded) for p in packs]))
    return out
