"""The engine: train a chain of layers with the task graph of a plan, for real.

Host memory holds the master weights (the user's model itself), their
gradients and the optimizer state; one optimizer per backward pack runs on
the CPU. The device holds only what the graph puts there: a pack's weights
while it runs, its gradient accumulator, activations in flight and stashed
inputs brought back for recompute. Every step plays the plan's TaskGraph with
:class:`~harmony.engine.executor.Executor`, one thread per lane, and records a
:class:`~harmony.trace.Trace` with the simulator's schema.

Exactness: with equal forward and backward microbatch sizes on one device in
float32, the weights after any number of steps are bitwise identical to
:func:`~harmony.engine.reference_loop.reference_step`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from ..errors import HarmonyError
from ..graph import (ACT_IN, ACT_OUT, BWD, DATA_IN, FWD, FWDBWD, G_OUT, P2P, STASH_IN, STASH_OUT, UPD, W_IN,
                     Task, TaskGraph)
from ..hardware import GB, Hardware
from ..plan import Plan
from ..policies import build_graph
from ..trace import Trace, summarize
from .decompose import decompose
from .describe import describe
from .devices import Backend, EmulatedBackend, make_backend
from .executor import Executor
from .profiler import SavedBytes
from .reference_loop import as_args, seed_layer

#: policies the single-device engine runs
SINGLE_DEVICE_POLICIES = ("harmony-pp", "virtual-memory")


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _assemble(pieces: list[tuple[tuple[int, int], tuple]], a: int, b: int) -> tuple:
    """The samples [a, b) of a value split in sample ranges (batch dimension 0)."""
    pieces = sorted(pieces, key=lambda p: p[0][0])
    if len(pieces) == 1 and pieces[0][0] == (a, b):
        return pieces[0][1]
    lo = pieces[0][0][0]
    out = []
    for i in range(len(pieces[0][1])):
        parts = [p[1][i] for p in pieces]
        if parts[0] is None:
            out.append(None)
            continue
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        out.append(whole[a - lo:b - lo])
    return tuple(out)


class Engine:
    """Synchronous SGD on a model larger than the device, one step at a time.

    ``model``: an nn.Sequential, a list of blocks, or anything
    :func:`~harmony.engine.decompose.decompose` can cut into a chain; it stays
    the host copy of the weights (``engine.model``). ``optimizer``: a factory
    called once per backward pack with that pack's parameters. ``loss_fn(out,
    target)``: the loss of the last layer's output. ``device``: ``"cpu"``,
    ``"cuda:N"`` or :class:`~harmony.engine.devices.EmulatedDevice`. ``plan``:
    a :class:`~harmony.plan.Plan` or ``"auto"`` (profile, then search).
    ``safe_updates``: a step that fails leaves weights, optimizer state and
    BatchNorm statistics as they were (updates overlapping the rest of the
    step are journaled and undone); off, a failed step may leave some packs
    updated.
    """

    def __init__(self, model, optimizer: Callable, loss_fn: Callable, device="cpu", minibatch_size: int = 32,
                 plan: Plan | str = "auto", seed: int = 0, safe_updates: bool = True):
        self.chain = decompose(model)
        self.layers: list[nn.Module] = list(self.chain.layers)
        # The host tensors of every layer, looked up once: while a compute thread runs
        # torch.func.functional_call on a layer, the layer's attributes point at device
        # tensors, so other threads must never read them from the module.
        self.host_params = [dict(layer.named_parameters()) for layer in self.layers]
        self.host_buffers = [dict(layer.named_buffers()) for layer in self.layers]
        self.model = model
        self.loss_fn = loss_fn
        self.backend: Backend = make_backend(device)
        self.backend.prepare_host(model if isinstance(model, nn.Module) else nn.ModuleList(self.layers))
        if not isinstance(minibatch_size, int) or minibatch_size < 1:
            raise HarmonyError(f"minibatch_size must be a positive integer, got {minibatch_size!r}")
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.safe_updates = safe_updates
        self.step_count = 0
        self.trace: Trace | None = None
        self._optimizer_factory = optimizer
        self._plan_arg = plan
        self.plan: Plan | None = None
        self.spec = None  # sizes of the chain, from the first minibatch
        self.profile = None  # measured costs, when plan="auto" profiled
        self.optimizers: list[torch.optim.Optimizer] = []
        self._graphs: dict[int, TaskGraph] = {}
        if isinstance(plan, Plan):
            self._set_plan(plan)
        elif plan != "auto":
            raise HarmonyError(f"plan must be a harmony.Plan or 'auto', got {plan!r}")

    # ---- set-up -------------------------------------------------------------------
    def hardware(self) -> Hardware:
        if isinstance(self.backend, EmulatedBackend):
            return self.backend.spec.hardware()
        return Hardware(name=self.backend.kind, n_gpus=1, gpu_memory=10**15, gpu_flops=1e12, h2d=100 * GB,
                        d2h=100 * GB, uplink=100 * GB, gpus_per_switch=1, p2p=None,
                        cpu_update_bandwidth=10 * GB, cpu_update_workers=1, host_memory=10**15)

    def _set_plan(self, plan: Plan) -> None:
        plan.validate(len(self.layers))
        if plan.policy not in SINGLE_DEVICE_POLICIES or plan.n_gpus != 1:
            raise HarmonyError(
                f"the single-device engine runs {SINGLE_DEVICE_POLICIES} on 1 GPU; got {plan.policy} on "
                f"{plan.n_gpus} GPUs"
            )
        if plan.minibatch != self.minibatch_size:
            raise HarmonyError(f"plan is for minibatch {plan.minibatch} but the engine's is {self.minibatch_size}")
        if plan.fwd_microbatch != plan.bwd_microbatch:
            for m in (m for layer in self.layers for m in layer.modules()):
                if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
                    why = "dropout: recompute must draw the forward pass's masks, which are seeded per microbatch"
                elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                    why = "BatchNorm: its batch statistics depend on the microbatch"
                else:
                    continue
                raise HarmonyError(
                    f"forward and backward microbatch sizes must be equal (got {plan.fwd_microbatch} and "
                    f"{plan.bwd_microbatch}) for a model with {why}"
                )
        self.plan = plan
        self._graphs.clear()
        self.optimizers = []
        for params in self._params_per_pack(plan):
            opt = self._optimizer_factory(params) if params else None
            if params and not isinstance(opt, torch.optim.Optimizer):
                raise HarmonyError(
                    f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer: "
                    "pass e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)"
                )
            self.optimizers.append(opt)

    def _params_per_pack(self, plan: Plan) -> list[list[nn.Parameter]]:
        """Each backward pack's parameters for its optimizer. A parameter shared by
        layers in several packs (tied weights) belongs to the pack that runs
        backward last, the one with the lowest layers: the packs after it only add
        their gradient to the host copy, so it is stepped once, with the sum."""
        owner: dict[int, int] = {}
        for q, (s, e) in enumerate(plan.bwd_packs):
            for layer in self.layers[s:e]:
                for p in layer.parameters():
                    owner.setdefault(id(p), q)
        out: list[list[nn.Parameter]] = []
        for q, (s, e) in enumerate(plan.bwd_packs):
            seen: set[int] = set()
            params = []
            for layer in self.layers[s:e]:
                for p in layer.parameters():
                    if owner[id(p)] == q and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            out.append(params)
        return out

    def _graph(self, inputs: tuple, target: torch.Tensor) -> TaskGraph:
        if self.spec is None:
            self.spec = describe(self.layers, inputs, target, name=type(self.model).__name__)
        if self.plan is None:
            from .planning import auto_plan

            self._set_plan(auto_plan(self, inputs, target))
        graph = self._graphs.get(0)
        if graph is None:
            graph = self._graphs[0] = build_graph(self.spec, self.hardware(), self.plan)
        return graph

    # ---- one step -----------------------------------------------------------------
    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous SGD iteration over a minibatch; returns its mean loss."""
        inputs = as_args(inputs)
        if target.shape[0] != self.minibatch_size or any(t.shape[0] != self.minibatch_size for t in inputs):
            raise HarmonyError(
                f"expected a minibatch of {self.minibatch_size} samples (dimension 0), got inputs "
                f"{[tuple(t.shape) for t in inputs]} and target {tuple(target.shape)}"
            )
        graph = self._graph(inputs, target)
        run = _StepRun(self, graph, inputs, target)
        try:
            run.execute()
        except BaseException:
            run.roll_back()
            raise
        self.step_count += 1
        self.trace = run.trace()
        return run.loss


class _StepRun:
    """The state of one step: device buffers, host-side values, counters."""

    def __init__(self, engine: Engine, graph: TaskGraph, inputs: tuple, target: torch.Tensor):
        self.e, self.graph, self.inputs, self.target = engine, graph, inputs, target
        self.backend = engine.backend
        self.store: dict[int, object] = {}  # buffer id -> what the device holds
        self.charged: dict[int, int] = {}
        self.refs = [b.refs for b in graph.buffers]
        self.host: dict[tuple, list] = defaultdict(list)  # (kind, layer) -> [((a, b), value)]
        self.moved: dict[str, float] = defaultdict(float)  # bytes by task kind
        self.moved_task: dict[int, float] = {}
        self.moved_by_link: dict[str, float] = defaultdict(float)  # "h2d" / "d2h"
        self.loss = 0.0
        self.lock = threading.Lock()
        # Updates that start while device work is still pending are journaled, so a
        # failure later in the step can undo them (safe_updates).
        self.journal: list[tuple[int, list, dict]] = []
        self.device_tasks_left = sum(1 for t in graph.tasks if t.kind != UPD)
        self.buffers_before = ([b.detach().clone() for b in engine.model.buffers()]
                               if engine.safe_updates else None)
        self.t0 = time.perf_counter()
        self.backend.ledger.reset(self.t0)

    # ---- bookkeeping --------------------------------------------------------------
    def put(self, buf: int, value, nbytes: int | None = None) -> None:
        n = _nbytes(value) if nbytes is None else nbytes
        self.backend.ledger.charge(n, self.graph.buffers[buf].what)
        with self.lock:
            self.store[buf] = value
            self.charged[buf] = n

    def finish(self, task: Task) -> None:
        if task.kind != UPD:
            with self.lock:
                self.device_tasks_left -= 1
        for b in task.releases:
            with self.lock:
                self.refs[b] -= 1
                last = self.refs[b] == 0
            if last:
                with self.lock:
                    self.store.pop(b, None)
                    n = self.charged.pop(b, 0)
                self.backend.ledger.release(n)

    def pieces(self, bufs: list[int]) -> list:
        return [(self.graph.buffers[b].samples, self.store[b]) for b in bufs]

    # ---- the step ------------------------------------------------------------------
    def execute(self) -> None:
        handlers = {W_IN: self.weights_in, DATA_IN: self.data_in, STASH_IN: self.host_in, ACT_IN: self.host_in,
                    STASH_OUT: self.host_out, ACT_OUT: self.host_out, P2P: self.peer_in, G_OUT: self.grads_out,
                    UPD: self.update, FWD: self.forward, FWDBWD: self.backward, BWD: self.backward}

        def run(task: Task) -> None:
            try:
                if task.kind == UPD:
                    handlers[task.kind](task)
                else:
                    with self.backend.lane(task.lane):
                        handlers[task.kind](task)
            except HarmonyError as err:
                raise type(err)(f"task {task.id} {task.kind} ({task.what}): {err}") from None
            self.finish(task)

        self.executor = Executor(self.graph, run)
        self.wall_s = self.executor.run(self.t0)

    def roll_back(self) -> None:
        """Undo a failed step: host weights, optimizer state and buffers as before it."""
        for pack, saved_params, saved_state in reversed(self.journal):
            opt = self.e.optimizers[pack]
            with torch.no_grad():
                for p, old in zip(_params(opt), saved_params):
                    p.copy_(old)
            opt.load_state_dict(saved_state)
        if self.buffers_before is not None:
            with torch.no_grad():
                for b, old in zip(self.e.model.buffers(), self.buffers_before):
                    b.copy_(old)
        for p in self.e.model.parameters():
            p.grad = None
        for n in self.charged.values():
            self.backend.ledger.release(n)
        self.store.clear()
        self.charged.clear()

    def trace(self) -> Trace:
        compute: dict[str, float] = defaultdict(float)
        cpu = 0.0
        ex = self.executor
        for t in self.graph.tasks:
            d = ex.end[t.id] - ex.start[t.id]
            if t.kind == UPD:
                cpu += d
            elif not t.is_transfer:
                compute[t.device] += d
        bounds = {f"compute:{k}": v for k, v in compute.items()}
        bounds["cpu_update"] = cpu / max(1, self.graph.cpu_workers)
        if isinstance(self.backend, EmulatedBackend):
            for direction, rate in self.backend.rates.items():
                bounds[f"link:{self.backend.name}.{direction}"] = self.moved_by_link[direction] / rate
        peak = {self.backend.name: self.backend.ledger.peak}
        cap = {self.backend.name: float(self.backend.ledger.capacity or float("inf"))}
        summary = summarize(self.wall_s, self.graph.samples, dict(self.moved), peak, cap, bounds)
        summary.update(policy=self.e.plan.policy, model=self.e.spec.name, hardware=self.backend.kind,
                       executor="engine")
        graph, start, end, moved_task = self.graph, list(ex.start), list(ex.end), dict(self.moved_task)

        def rows():
            return [
                {"device": t.device, "lane": t.lane, "kind": t.kind, "model": t.model, "pack": t.pack,
                 "microbatch": t.microbatch, "start_s": start[t.id], "end_s": end[t.id],
                 "bytes": moved_task.get(t.id, 0.0), "layers": t.layers, "what": t.what}
                for t in graph.tasks
            ]

        return Trace(summary, {self.backend.name: list(self.backend.ledger.history)}, rows)

    # ---- transfers -------------------------------------------------------------------
    def _copy(self, task: Task, value, to_device: bool):
        started = time.perf_counter()
        conv = self.backend.to_device if to_device else self.backend.to_host
        out = tuple(None if v is None else conv(v) for v in value)
        n = _nbytes(out)
        self.backend.pace(n, "h2d" if to_device else "d2h", started)
        self._count(task, n, "h2d" if to_device else "d2h")
        return out

    def _count(self, task: Task, n: float, direction: str) -> None:
        with self.lock:
            self.moved[task.kind] += n
            self.moved_task[task.id] = self.moved_task.get(task.id, 0.0) + n
            self.moved_by_link[direction] += n

    def weights_in(self, task: Task) -> None:
        s, e = task.layers
        backward = "grads" in task.io
        started = time.perf_counter()
        weights = {}
        for i in range(s, e):
            tensors = {}
            for name, p in self.e.host_params[i].items():
                tensors[name] = self.backend.to_device(p).requires_grad_(backward and p.requires_grad)
            for name, b in self.e.host_buffers[i].items():
                tensors[name] = self.backend.to_device(b)
            weights[i] = tensors
        n = _nbytes(weights)
        self.backend.pace(n, "h2d", started)
        self._count(task, n, "h2d")
        self.put(task.io["weights"], weights, n)
        if backward:
            leaves = {i: {k: v for k, v in w.items() if isinstance(v, torch.Tensor) and v.requires_grad}
                      for i, w in weights.items()}
            self.put(task.io["grads"], leaves, sum(_nbytes(list(d.values())) for d in leaves.values()))

    def data_in(self, task: Task) -> None:
        what, a, b = task.data
        value = tuple(t[a:b] for t in self.inputs) if what == "inputs" else (self.target[a:b],)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def host_in(self, task: Task) -> None:
        kind, layer, a, b = task.data
        if kind == "stash" and layer == 0:
            value = tuple(t[a:b] for t in self.inputs)
        else:
            with self.lock:
                pieces = [p for p in self.host[(kind, layer)] if p[0][0] < b and a < p[0][1]]
            value = _assemble(pieces, a, b)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def host_out(self, task: Task) -> None:
        kind, layer, a, b = task.data
        value = _assemble(self.pieces(task.io["src"]), a, b)
        out = self._copy(task, value, to_device=False)
        with self.lock:
            self.host[(kind, layer)].append(((a, b), out))

    def peer_in(self, task: Task) -> None:
        _, _, a, b = task.data
        value = _assemble(self.pieces(task.io["src"]), a, b)
        self.put(task.io["dst"], self._copy(task, value, to_device=True))

    def grads_out(self, task: Task) -> None:
        started = time.perf_counter()
        leaves = self.store[task.io["src"][0]]
        n = 0
        for i, tensors in leaves.items():
            params = self.e.host_params[i]
            for name, leaf in tensors.items():
                if leaf.grad is None:
                    continue
                g = self.backend.to_host(leaf.grad)
                n += g.numel() * g.element_size()
                host = params[name]
                if host.grad is None:
                    host.grad = g if g is not leaf.grad else g.clone()
                else:
                    host.grad += g
        self.backend.pace(n, "d2h", started)
        self._count(task, n, "d2h")

    def update(self, task: Task) -> None:
        opt = self.e.optimizers[task.pack]
        if opt is None:
            return
        with self.lock:
            pending = self.device_tasks_left > 0
        if self.e.safe_updates and pending:
            self.journal.append((task.pack, [p.detach().clone() for p in _params(opt)],
                                 _clone_state(opt.state_dict())))
        opt.step()
        opt.zero_grad(set_to_none=True)

    # ---- compute ----------------------------------------------------------------------
    def _run_layers(self, task: Task, weights: dict, h: tuple, stash: dict | None = None,
                    charge_intermediates: bool = False) -> tuple:
        """Run the task's layers on ``h``. Without autograd, each layer's output is
        charged to the ledger while the next layer computes (with autograd, the
        saved-tensor meter charges what stays)."""
        s, e = task.layers
        device = self.backend.torch_device
        ledger, held = self.backend.ledger, 0
        try:
            for i in range(s, e):
                if stash and i in stash:
                    self.put(stash[i], h)
                seed_layer(self.e.seed, self.e.step_count, task.microbatch, i, device)
                h = as_args(functional_call(self.e.layers[i], weights[i], h))
                if charge_intermediates and i < e - 1:
                    n = _nbytes(h)
                    ledger.charge(n, f"activations inside {task.what}")
                    ledger.release(held)
                    held = n
        finally:
            ledger.release(held)
        return h

    def _write_back_buffers(self, task: Task, weights: dict) -> None:
        """BatchNorm-like buffers changed by a real forward go back to the host copy."""
        with torch.no_grad():
            for i in range(*task.layers):
                for name, b in self.e.host_buffers[i].items():
                    b.copy_(weights[i][name])

    def forward(self, task: Task) -> None:
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        h = _assemble(self.pieces(task.io["input"]), a, b)
        with torch.no_grad():
            out = self._run_layers(task, weights, h, task.io.get("stash"), charge_intermediates=True)
        self.put(task.io["output"], out)
        self._write_back_buffers(task, weights)

    def backward(self, task: Task) -> None:
        s, e = task.layers
        a, b = task.samples
        weights = self.store[task.io["weights"]]
        fused = task.kind == FWDBWD
        h = _assemble(self.pieces(task.io["input" if fused else "stash_in"]), a, b)
        if s > 0:
            h = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in h)
        saved_before = None if fused else {
            (i, name): weights[i][name].clone() for i in range(s, e) for name in self.e.host_buffers[i]}
        ledger = self.backend.ledger
        meter = SavedBytes(lambda n: ledger.charge(n, f"autograd-saved tensors of {task.what}"))
        try:
            with meter, torch.enable_grad():
                out = self._run_layers(task, weights, h)
                if fused:
                    y = self.store[task.io["labels"]][0]
                    loss = self.e.loss_fn(*out, y) * ((b - a) / self.graph.samples)
            if fused:
                loss.backward()
                with self.lock:
                    self.loss += loss.item()
            else:
                grad_in = _assemble(self.pieces(task.io["grad_in"]), a, b)
                pairs = [(o, g) for o, g in zip(out, grad_in) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            ledger.release(meter.total)
        if fused:
            self._write_back_buffers(task, weights)
        else:
            with torch.no_grad():  # recompute must not count twice in running statistics
                for (i, name), old in saved_before.items():
                    weights[i][name].copy_(old)
        if s > 0:
            self.put(task.io["output"], tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                                              for t in h))


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _clone_state(state: dict) -> dict:
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clone(x) for x in v]
        return v

    return clone(state)
