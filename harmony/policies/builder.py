"""The machinery every policy shares: turn a list of compute ops into a TaskGraph.

A policy decides *what* runs *where* and in *which order* — a list of
:class:`Op` (forward, backward or fused forward+loss+backward of one pack on
one microbatch, on one GPU) in a global order that respects data flow. The
builder adds everything that follows from it, the same way for every policy:

* weights: when a GPU moves on to an op of a new *weight group* (a pack, or for
  baselines a pack on one microbatch), the weights cross the link (W_IN); the
  transfer may start once the group ``prefetch_packs`` back on that GPU has
  ended, so at most that many groups are resident (double buffering by default);
  backward groups also hold a gradient buffer, accumulated over the group;
* activations and their gradients between packs: nothing moves when producer
  and consumer share a GPU, a P2P copy when they do not, a round trip through
  host memory when the policy asks to offload; an input is prefetched while the
  op two before it on the GPU computes;
* stashes: the input of every backward pack but the fused last one is saved to
  host memory by the forward op that computes it and brought back, re-chunked
  to the backward microbatch, before recompute;
* recompute: a backward op is two compute tasks on its GPU, back to back in
  the lane's order. REC recomputes the pack's forward with autograd; it needs
  the weights and the stashed input only, so with the plan's
  ``overlap_recompute`` (Harmony's schedule) it runs while the output gradient
  is still on its way, and only BWD, the backward proper, waits for the
  gradient. REC takes the spec's forward time, BWD the rest of the spec's
  backward-with-recompute time (as the Harmony authors' simulator splits it).
  REC allocates the backward's working memory (the tensors autograd saves),
  BWD frees it, with the stashed input and the gradient, when it ends;
* data: the minibatch inputs and labels come from host memory;
* memory: every buffer above is allocated on its device when the task that
  creates it starts and freed when the last task that needs it ends;
* fixed cost: ``Hardware.task_overhead_s`` on every compute task, or once per
  weight group (on its first compute task) when ``Hardware.overhead_per`` is
  ``"pack"``.
* the disk tier: where the plan's state does not fit host memory, reads and
  writes of what lives on disk around the updates and weight loads that need
  it (:mod:`.disk_tier`, when the graph is finished).

The parts: :mod:`.base` (ops, buffers, transfers, routes), :mod:`.activations`
(values between ops), this module (weights, compute, gradients, updates),
:mod:`.disk_tier`.

Gradients leaving the GPU and the optimizer updates are policy-specific
(one G_OUT per group, per microbatch, or after a reduce-scatter), so the
builder records each backward group and the policy finishes it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..graph import (
    ACT_IN,
    BWD,
    FWD,
    FWDBWD,
    G_OUT,
    REC,
    STASH_IN,
    UPD,
    W_IN,
    Gradients,
    Task,
    TaskGraph,
    TiedGradients,
    Update,
    Weights,
)
from ..plan import Plan, layer_shard
from .activations import ActivationFlow
from .base import HOST, Op
from .compute_time import compute_cost
from .disk_tier import add_disk_tasks

__all__ = ["BwdGroup", "GraphBuilder", "Op"]


@dataclass
class BwdGroup:
    """A backward weight group: its gradient accumulates on ``gpu`` until the policy sends it
    out."""

    gpu: int
    pack: int
    layers: tuple[int, int]
    ops: list[int] = field(default_factory=list)
    grad_buffer: int = -1


@dataclass
class _Group:
    """Ops back to back on one GPU that share one load of weights."""

    key: tuple
    w_task: int
    ops: list[int]
    bwd: BwdGroup | None


class GraphBuilder(ActivationFlow):
    """A policy's ops turned into a :class:`TaskGraph` (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        hw: Hardware,
        plan: Plan,
        model: int = 0,
        split_ties: bool = True,
        overlap_recompute: bool | None = None,
        gradient_window: bool = False,
        weights_with_update: bool = False,
    ):
        """``split_ties``: the gradient of a parameter that the group's layers share
        with layers of other packs (:class:`~harmony.costs.spec.Tie`) leaves the GPU after
        every microbatch, so that the host sums the packs' parts per microbatch
        as autograd does (exactness); off for policies that reduce gradients
        across GPUs, where the part stays in the group's gradient.
        ``overlap_recompute``: whether a backward op's REC may run before its
        output gradient is there (None: as the plan's option says; False for
        systems that recompute only once the gradient has arrived).
        ``gradient_window``: the policy's packs' gradients arrive pack after pack,
        so where host memory is short they can be held in slots (:mod:`.disk_tier`).
        ``weights_with_update``: each pack's one CPU update follows its backward,
        so master weights on disk are read once for both (:mod:`.disk_tier`)."""
        super().__init__(spec, hw, plan, model)
        self.gradient_window = gradient_window
        self.weights_with_update = weights_with_update
        self._k = 0  # seq of compute ops
        self._groups_on: dict[int, list[_Group]] = {g: [] for g in range(plan.n_gpus)}
        self.bwd_groups: list[BwdGroup] = []
        self._costs: dict[tuple, tuple[float, float]] = {}
        self._prefetch = plan.option("prefetch_packs")
        self._overlap = (
            plan.option("overlap_recompute") if overlap_recompute is None else overlap_recompute
        )
        self.split_ties = split_ties and bool(spec.ties)
        # (layers of the op, its tied-gradient G_OUT)
        self._tie_pieces: list[tuple[tuple[int, int], int]] = []

    def tie_parts(self, layers: tuple[int, int]) -> list[int]:
        """The tasks that bring in the parts of the gradients of parameters tied
        into ``layers`` from other packs: all are in before the pack of a tied
        parameter's first layer steps it (on the host, or on a GPU after OPT_IN)."""
        owned = {tie for tie in self.spec.ties if layers[0] <= tie.layers[0] < layers[1]}
        return [
            out for (a, b), out in self._tie_pieces if any(tie.in_range(a, b) for tie in owned)
        ]

    def update(
        self,
        pack: int,
        layers: tuple[int, int],
        deps: list[int],
        worker: int,
        shard: tuple[int, int] = (0, 1),
    ) -> Task:
        """The CPU optimizer step of a pack's parameters, or of its ``shard``
        ``(r, k)``: the layers :func:`layer_shard` gives."""
        deps = sorted(set(deps) | set(self.tie_parts(layers)))
        duration = sum(
            self.spec.update_time(i, i + 1, self.hw.cpu_update_bandwidth)
            for i in layer_shard(layers, *shard)
        )
        lane = f"cpu{worker % self.hw.cpu_update_workers}"
        return self._add(
            Task(
                len(self.tasks),
                UPD,
                lane,
                "cpu",
                self._next_seq(deps, None),
                deps,
                duration=duration,
                model=self.model,
                pack=pack,
                layers=layers,
                what=f"update {layers}"
                + (f" shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""),
                data=Update(layers, shard),
            )
        )

    # ---- ops -------------------------------------------------------------------
    def run(self, ops: list[Op]) -> None:
        for op in ops:
            self._op(op)
        for g, groups in self._groups_on.items():
            if groups:
                self._close_group(g)

    def _op(self, op: Op) -> None:
        k = self._k + 1  # this op's place in the global order
        group, opens_group = self._weights_for(op, k)
        deps: list[int] = [group.w_task]
        local: list[int] = []  # buffers this op releases when it ends
        io: dict = {"weights": self.tasks[group.w_task].io["weights"]}
        if group.bwd is not None:
            io["grads"] = group.bwd.grad_buffer
        if op.kind == FWD or op.kind == FWDBWD:
            self._inputs(op, k, deps, local, io)
        input_buffers = list(local)
        if op.kind == FWDBWD:
            y = self._batch_in(
                op, k, "labels", self.spec.target_bytes(op.samples[1] - op.samples[0])
            )
            deps.append(y.id)
            local += y.allocs
            io["labels"] = y.io["dst"]
        self._k = k
        t = self._compute_op(op, k, deps, local, io, opens_group)
        group.ops.append(t.id)
        if group.bwd is not None:
            group.bwd.ops.append(t.id)
        self._outputs(op, t, io, input_buffers)

    def _weights_for(self, op: Op, k: int) -> tuple[_Group, bool]:
        """The weight group of ``op`` on its GPU, and whether the op opens it: then the
        weights' load (W_IN; for backward, with the gradient accumulator)."""
        spec, g = self.spec, op.gpu
        dev = self._dev[g]
        s, e = op.layers
        groups = self._groups_on[g]
        opens_group = not groups or groups[-1].key != op.group
        if opens_group:
            if groups:
                self._close_group(g)
            # prefetch window: the load waits for the group `prefetch_packs` back to end
            back = [groups[-self._prefetch].ops[-1]] if len(groups) >= self._prefetch else []
            w = self.transfer(
                W_IN,
                f"{dev}.h2d",
                dev,
                self.h2d_route(g),
                spec.weight_bytes(s, e),
                back,
                f"weights {op.layers}",
                alloc_on=dev,
                for_op=k,
                data=Weights((s, e)),
                pack=op.pack,
                layers=op.layers,
                microbatch=op.microbatch if len(op.group) > 2 else -1,
            )
            w.io["weights"] = w.io.pop("dst")
            bwd = None
            if op.kind != FWD:
                grad = self.buffer(
                    dev, spec.grad_bytes(s, e) - self._split_bytes(s, e), f"grads {op.layers}"
                )
                w.allocs.append(grad)
                w.io["grads"] = grad
                bwd = BwdGroup(g, op.pack, op.layers, grad_buffer=grad)
                self.bwd_groups.append(bwd)
            groups.append(_Group(op.group, w.id, [], bwd))
        return groups[-1], opens_group

    def _inputs(self, op: Op, k: int, deps: list[int], local: list[int], io: dict) -> None:
        """A forward op's input: the minibatch's from host memory, or the activations
        that reach its first layer."""
        s, n = op.layers[0], op.samples[1] - op.samples[0]
        if s == 0:
            x = self._batch_in(op, k, "inputs", self.spec.input_bytes(0, n))
            deps.append(x.id)
            local += x.allocs
        else:
            d, bufs = self._bring(("act", s), op, k, ACT_IN, self.spec.input_bytes(s, n))
            deps += d
            local += bufs
        io["input"] = list(local)

    def _compute_op(
        self, op: Op, k: int, deps: list[int], local: list[int], io: dict, opens_group: bool
    ) -> Task:
        """The op's compute task (for backward, REC then BWD), which releases what the
        op used; the task that ends it."""
        if op.kind == BWD:
            # REC: the recompute, once the weights and the stashed input are in (and,
            # without overlap, the gradient too); its working memory is what autograd
            # saves, kept until BWD, the backward proper, has used it.
            (s, e), n, spec = op.layers, op.samples[1] - op.samples[0], self.spec
            stash_deps, stash = self._bring(("stash", s), op, k, STASH_IN, spec.input_bytes(s, n))
            grad_deps, grad = self._bring(("grad", e), op, k, ACT_IN, spec.input_grad_bytes(e, n))
            waits = deps + stash_deps + ([] if self._overlap else grad_deps)
            rec = self._compute(
                op,
                REC,
                (k, 1, 0),
                waits,
                {"weights": io["weights"], "stash_in": stash},
                opens_group,
            )
            deps += [rec.id] + grad_deps
            local += stash + grad
            io.update(grad_in=grad, saved=rec.io["work"])
            t = self._compute(op, BWD, (k, 1, 1), deps, io, False)
            self.release(t, io["saved"])
        else:
            t = self._compute(op, op.kind, (k, 1, 0), deps, io, opens_group)
            self.release(t, io["work"])
        self.release_all(t, local)
        self._ops_on[op.gpu].append(t.id)
        return t

    def _outputs(self, op: Op, t: Task, io: dict, input_buffers: list[int]) -> None:
        """What the op's task ``t`` hands on: a tied parameter's gradient piece, the
        stashes, and the activations (forward) or their gradient (backward)."""
        dev, (s, e), n = self._dev[op.gpu], op.layers, op.samples[1] - op.samples[0]
        if op.kind != FWD and self._split_bytes(s, e):
            self._tie_piece(op, t)
        if op.kind == FWD:
            self._stash(op, t, input_buffers)
            out = self.buffer(
                dev,
                self.spec.input_bytes(e, n),
                f"activations into layer {e} {self.pair(op.samples)}",
                op.samples,
            )
            t.allocs.append(out)
            io["output"] = out
            self._produce(("act", e), op, t, out)
        elif s > 0:
            out = self.buffer(
                dev,
                self.spec.input_grad_bytes(s, n),
                f"gradient into layer {s} {self.pair(op.samples)}",
                op.samples,
            )
            t.allocs.append(out)
            io["output"] = out
            self._produce(("grad", s), op, t, out)

    def _split_bytes(self, s: int, e: int) -> int:
        return self.spec.split_tie_bytes(s, e) if self.split_ties else 0

    def _tie_piece(self, op: Op, task: Task) -> None:
        """This microbatch's gradient of the parameters the op's layers share with
        other packs: a buffer the op fills, sent to the host at once."""
        dev = self._dev[op.gpu]
        nbytes = self._split_bytes(*op.layers)
        piece = self.buffer(dev, nbytes, f"tied gradients {op.layers} {op.samples}", op.samples)
        task.allocs.append(piece)
        task.io["tied"] = piece
        out = self.transfer(
            G_OUT,
            f"{dev}.d2h",
            dev,
            self.d2h_route(op.gpu),
            nbytes,
            [task.id],
            f"tied gradients {op.layers} {op.samples}",
            data=TiedGradients(op.layers, op.samples),
            src=[piece],
            pack=op.pack,
            layers=op.layers,
            microbatch=op.microbatch,
            samples=op.samples,
        )
        self._tie_pieces.append((op.layers, out.id))

    def _compute(
        self,
        op: Op,
        kind: str,
        seq: tuple[int, int, int],
        deps: list[int],
        io: dict,
        opens_group: bool,
    ) -> Task:
        """A compute task of ``op`` with its working memory (``io["work"]``; none for
        BWD, whose REC holds it), charged the hardware's fixed cost per task, or per
        weight group on the task that ``opens_group``."""
        s, e = op.layers
        a, b = op.samples
        dev = self._dev[op.gpu]
        # microbatches repeat: each cost is worked out once (compute_time.compute_cost)
        key = (kind, s, e, b - a)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = compute_cost(self.spec, self.hw.gpu_flops, kind, s, e, b - a)
        duration, work = cost
        if self.hw.overhead_per == "task" or opens_group:
            duration += self.hw.task_overhead_s
        tasks = self.tasks
        # every field given in order (see base.GraphBase.transfer)
        t = Task(
            len(tasks),
            kind,
            self._compute_lane[op.gpu],
            dev,
            seq,
            sorted(set(deps)),
            duration,
            0.0,
            (),
            math.inf,
            self.model,
            op.pack,
            op.layers,
            op.microbatch,
            op.samples,
            f"{kind} layers {self.span(op.layers)} samples {self.span(op.samples)}",
            None,
            io,
            [],
            [],
            (),
        )
        tasks.append(t)
        if work is not None:
            what = f"working memory {kind} {self.pair(op.layers)}"
            t.allocs.append(self.buffer(dev, work, what))
            io["work"] = t.allocs[-1]
        return t

    def _close_group(self, g: int) -> None:
        """The last op of the current group on ``g`` frees its weights."""
        group = self._groups_on[g][-1]
        self.release(self.tasks[group.ops[-1]], self.tasks[group.w_task].allocs[0])

    # ---- gradients out -----------------------------------------------------------
    def grad_out(
        self,
        group: BwdGroup,
        deps: list[int] | None = None,
        shard: tuple[int, int] = (0, 1),
        replicas: list[BwdGroup] | None = None,
    ) -> Task:
        """The group's gradient to host memory, or for data parallel the ``shard``
        ``(r, k)`` of it summed over the ``replicas`` (every replica's accumulator
        is read, and freed once every shard is out)."""
        dev = self._dev[group.gpu]
        replicas = replicas or [group]
        if shard == (0, 1):  # a tied parameter once, and its split part already out
            nbytes = self.spec.grad_bytes(*group.layers) - self._split_bytes(*group.layers)
        else:
            nbytes = sum(self.spec.grad_bytes(i, i + 1) for i in layer_shard(group.layers, *shard))
        return self.transfer(
            G_OUT,
            f"{dev}.d2h",
            dev,
            self.d2h_route(group.gpu),
            nbytes,
            [group.ops[-1]] + list(deps or []),
            f"gradients {group.layers}",
            data=Gradients(group.layers, shard),
            src=[g.grad_buffer for g in replicas],
            pack=group.pack,
            layers=group.layers,
            microbatch=self.tasks[group.ops[-1]].microbatch if len(group.ops) == 1 else -1,
        )

    def graph(self, **info) -> TaskGraph:
        """The graph built, with the disk tier's transfers where the plan's state
        does not fit host memory (:mod:`.disk_tier`)."""
        for buf in self.buffers:
            if buf.device != HOST and buf.refs == 0:
                raise AssertionError(f"buffer never freed: {buf}")
        disk = add_disk_tasks(self, self.gradient_window, self.weights_with_update)
        if disk is not None:
            info["disk"] = disk
        return TaskGraph(
            tasks=self.tasks,
            buffers=self.buffers,
            links=dict(self.links),
            memory_capacity={
                f"gpu{g}": float(self.hw.gpu_memory) for g in range(self.plan.n_gpus)
            },
            samples=self.plan.minibatch,
            cpu_workers=self.hw.cpu_update_workers,
            info={
                "plan": self.plan.to_dict(),
                "model": self.spec.name,
                "hardware": self.hw.name,
                **info,
            },
        )
