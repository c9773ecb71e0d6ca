"""The engine: train a chain of layers with the task graph of a plan, for real.

Host memory holds the master weights (the user's model itself), their
gradients and the optimizer state; one optimizer per backward pack (per
shard of a pack in data parallel) runs on the CPU. The devices hold only what
the graph puts there: a pack's weights while it runs, its gradient
accumulator, activations in flight and stashed inputs brought back for
recompute. Every step plays the plan's TaskGraph (see :mod:`.step`), one
thread per lane, and records a :class:`~harmony.trace.Trace` with the
simulator's schema.

Exactness: with equal forward and backward microbatch sizes in float32, the
weights after any number of steps are bitwise identical to
:func:`~harmony.engine.reference_loop.reference_step` on one device and with
harmony-pp on several; harmony-dp sums gradients across GPUs in another order
(allclose).
"""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, NonFiniteError
from ..graph import TaskGraph
from ..plan import Plan, layer_shard
from ..policies import POLICIES, build_graph, get_policy, update_shards
from ..simulate import play, simulate_graph
from ..trace import Trace
from .buffers import BufferPool, HostLayout
from .calibrate import calibrate
from .checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from .decompose import decompose
from .describe import describe, microbatch_dependence, norm_tensor_names
from .devices import Backend, make_backends
from .host_memory import check_host_memory
from .reference_loop import as_args
from .state import FORMAT as STATE_FORMAT
from .state import (
    apply_state,
    check_state,
    engine_state,
    load_optimizer_state,
    optimizer_state,
    param_names,
)
from .updates import UpdateJournal, optimizer_params

NONFINITE = ("raise", "skip")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GROWTH_INTERVAL = 2000


class Engine:
    """Synchronous SGD on a model larger than the device, one step at a time.

    ``model``: an nn.Sequential, a list of blocks, or anything
    :func:`~harmony.engine.decompose.decompose` can cut into a chain; it stays
    the host copy of the weights (``engine.model``). ``optimizer``: a factory
    called once per backward pack (per shard in data parallel) with those
    parameters. ``loss_fn(out, target)``: the loss of the last layer's output.
    ``device``: ``"cpu"``, ``"cuda:N"``, a list of CUDA devices,
    :class:`~harmony.engine.devices.EmulatedDevice` or
    :class:`~harmony.engine.devices.EmulatedServer`. ``plan``: a
    :class:`~harmony.plan.Plan` or ``"auto"`` (profile, then search).
    ``safe_updates``: a step that fails leaves weights, optimizer state and
    BatchNorm statistics as they were (updates overlapping the rest of the
    step are journaled and undone); off, a failed step may leave some packs
    updated. ``distributed``: average gradients across the servers of the
    default torch.distributed process group (default: when one with more than
    one process is initialized); ``minibatch_size`` is then per server.
    ``nonfinite``: what a step whose loss or gradient is NaN or infinite does,
    found before that gradient is applied: ``"raise"`` a
    :class:`~harmony.errors.NonFiniteError` with the state as before the step,
    or ``"skip"`` the step (state as before it, the step counted in
    ``skipped_steps``, ``step`` returns nan).
    ``precision``: ``"fp32"``, or mixed precision ``"bf16"`` / ``"fp16"``:
    weights, activations and gradients cross the links and are computed in
    that dtype (under ``torch.autocast``), except BatchNorm's parameters and
    statistics, which stay float32 as autocast keeps them (rounded to bf16 at
    every load, running statistics would drift); master weights and optimizer
    state stay float32 on the host; fp16 adds dynamic loss scaling (an overflowing
    step is skipped and the scale halved, as ``torch.amp.GradScaler`` does).

    Checkpoints: :meth:`save` / :meth:`load` (atomic, checksummed files) and
    :meth:`state_dict` / :meth:`load_state_dict`. A run resumed from a
    checkpoint continues bitwise as if it had never stopped.
    """

    def __init__(
        self,
        model,
        optimizer: Callable,
        loss_fn: Callable,
        device="cpu",
        minibatch_size: int = 32,
        plan: Plan | str = "auto",
        seed: int = 0,
        safe_updates: bool = True,
        distributed: bool | None = None,
        nonfinite: str = "raise",
        precision: str = "fp32",
        spec: ModelSpec | None = None,
        hardware: Hardware | None = None,
    ):
        if nonfinite not in NONFINITE:
            raise HarmonyError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        if precision not in PRECISIONS:
            raise HarmonyError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise HarmonyError(f"seed must be a non-negative integer, got {seed!r}")
        if not callable(optimizer):
            raise HarmonyError(
                f"optimizer must be a factory such as lambda params: torch.optim.AdamW(params, "
                f"lr=3e-4), got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise HarmonyError(
                "loss_fn must be callable as loss_fn(output, target), got "
                f"{type(loss_fn).__name__}"
            )
        self.chain = decompose(model)
        self.layers: list[nn.Module] = list(self.chain.layers)
        check_on_host(self.layers)
        self.model = model
        # the module whose state_dict holds every host weight and buffer
        self.host_module = model if isinstance(model, nn.Module) else nn.ModuleList(self.layers)
        self.loss_fn = loss_fn
        self.device = device
        self.backends: list[Backend] = make_backends(device)
        # Host weights in flat buffers (one copy per pack), page-locked for a GPU;
        # host buffers for what a step sends to the host, reused from step to step
        gpu = any(b.kind == "cuda" for b in self.backends)
        self.host_layout = HostLayout(self.layers, pin=gpu)
        self.host_pool = BufferPool("cpu", pin=gpu)
        # The host tensors of every layer, looked up once: while a compute thread runs
        # torch.func.functional_call on a layer, the layer's attributes point at device
        # tensors, so other threads must never read them from the module.
        self.host_params = [dict(layer.named_parameters()) for layer in self.layers]
        self.host_buffers = [dict(layer.named_buffers()) for layer in self.layers]
        # parameters several layers share (tied weights): the layers and the first name in each
        self.tied: dict[int, list[tuple[int, str]]] = {}
        for i, params in enumerate(self.host_params):
            for name, p in params.items():
                self.tied.setdefault(id(p), []).append((i, name))
        self.tied = {k: v for k, v in self.tied.items() if len(v) > 1}
        self._split_ties: dict[tuple[int, int], list] = {}
        # BatchNorm's parameters and statistics keep their dtype under mixed precision
        self.norm_tensors = [norm_tensor_names(layer) for layer in self.layers]
        # Layers that draw random numbers: with several compute threads, seeding the
        # generator and running such a layer must not interleave. A layer whose dropout
        # is functional (no module to find) says so with draws_random (see decompose).
        self.random_layers = {
            i
            for i, layer in enumerate(self.layers)
            if getattr(layer, "draws_random", False)
            or any(
                isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in layer.modules()
            )
        }
        self.rng_lock = threading.Lock()
        self._replicas: dict[tuple[int, int], nn.Module] = {}
        self._replica_lock = threading.Lock()
        if (
            not isinstance(minibatch_size, int)
            or isinstance(minibatch_size, bool)
            or minibatch_size < 1
        ):
            raise HarmonyError(
                f"minibatch_size must be a positive integer, got {minibatch_size!r}"
            )
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.safe_updates = safe_updates
        self.journal = (
            UpdateJournal()
        )  # what a step's updates changed, to undo it if the step fails
        self.nonfinite = nonfinite
        self.precision = precision
        self.compute_dtype: torch.dtype | None = PRECISIONS[precision]
        # fp16: dynamic loss scaling as torch.amp.GradScaler does it (an overflowing
        # step is skipped and the scale halved; it doubles after GROWTH_INTERVAL good steps)
        self.loss_scale = 2.0**16 if precision == "fp16" else 1.0
        self.good_steps = 0
        self.step_count = 0
        self.skipped_steps = 0
        self.trace: Trace | None = None
        self._optimizer_factory = optimizer
        self.plan: Plan | None = None
        if spec is not None and not isinstance(spec, ModelSpec):
            raise HarmonyError(
                "spec must be a harmony.ModelSpec (e.g. from harmony.profile), got "
                f"{type(spec).__name__}"
            )
        if hardware is not None and not isinstance(hardware, Hardware):
            raise HarmonyError(
                f"hardware must be a harmony.Hardware, got {type(hardware).__name__}"
            )
        self.spec = None  # sizes of the chain, from the first minibatch
        # the cost model with times the graph is played with (the memory order): given,
        # or measured when plan="auto" profiles; None: the sizes, with FLOP-rate times
        self.profile = spec
        self._hardware = hardware
        self.optimizers: dict[
            tuple[int, int], torch.optim.Optimizer | None
        ] = {}  # (pack, shard) ->
        self._graph_cache: TaskGraph | None = None
        self._memory_order: dict | None = None  # of the cached graph's buffers, per device
        self._batch_kinds: tuple | None = None  # shapes and dtypes of the first minibatch
        if distributed is None:
            distributed = (
                torch.distributed.is_available()
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1
            )
        self.distributed = distributed
        self.sync = None  # GradientSync across servers, once a plan is set
        if distributed:
            from .distributed import broadcast_weights

            broadcast_weights(self.host_module)
        if isinstance(plan, Plan):
            self.set_plan(plan)
        elif plan != "auto":
            raise HarmonyError(f"plan must be a harmony.Plan or 'auto', got {plan!r}")

    @property
    def backend(self) -> Backend:
        """The first device (the only one on a single-device engine)."""
        return self.backends[0]

    # ---- set-up -------------------------------------------------------------------
    def hardware(self) -> Hardware:
        """The devices as the planner and the simulator see them: as given, or
        calibrated on this machine (:func:`~harmony.engine.calibrate.calibrate`)."""
        return self._hardware if self._hardware is not None else calibrate(self.device)

    def simulate(self) -> Trace:
        """The simulator's play of the graph the engine runs (after the first step):
        the engine takes device memory in this play's order, so its peak is this
        trace's peak."""
        if self._graph_cache is None:
            raise HarmonyError(
                "the engine has no graph yet: it is made from the first minibatch; run a step "
                "first"
            )
        return simulate_graph(self._graph_cache)

    def set_plan(self, plan: Plan) -> None:
        """Run the next steps with ``plan`` (e.g. a smaller one after an
        out-of-memory error). Optimizer state carries over whatever the packing."""
        if not isinstance(plan, Plan):
            raise HarmonyError(f"plan must be a harmony.Plan, got {type(plan).__name__}")
        plan.validate(len(self.layers))
        get_policy(plan.policy)  # an unknown or renamed policy: a clear error
        if plan.policy not in POLICIES:
            raise HarmonyError(
                f"the engine runs the policies {', '.join(POLICIES)}; got {plan.policy!r}"
            )
        if plan.n_gpus != len(self.backends):
            raise HarmonyError(
                f"plan is for {plan.n_gpus} GPUs but the engine has {len(self.backends)} "
                f"({', '.join(b.name for b in self.backends)})"
            )
        if plan.minibatch != self.minibatch_size:
            raise HarmonyError(
                f"plan is for minibatch {plan.minibatch} but the engine's is {self.minibatch_size}"
            )
        if plan.option("precision") not in (None, self.precision):
            raise HarmonyError(
                f"plan is for precision {plan.option('precision')!r} but the engine's is "
                f"{self.precision!r}: make the engine with precision={plan.option('precision')!r}"
            )
        if plan.fwd_microbatch != plan.bwd_microbatch:
            why = microbatch_dependence(self.layers)
            if why is not None:
                raise HarmonyError(
                    "forward and backward microbatch sizes must be equal (got "
                    f"{plan.fwd_microbatch} and {plan.bwd_microbatch}) for a model with {why}"
                )
        optimizers = {}
        for key, params in self._params_per_update(plan).items():
            opt = self._optimizer_factory(params) if params else None
            if params and not isinstance(opt, torch.optim.Optimizer):
                raise HarmonyError(
                    f"optimizer factory returned {type(opt).__name__}, not a "
                    "torch.optim.Optimizer: pass e.g. lambda params: torch.optim.AdamW(params, "
                    "lr=3e-4)"
                )
            if params:
                check_optimizer_holds(opt, params)
            optimizers[key] = opt
        names = param_names(self)
        load_optimizer_state(optimizers, optimizer_state(self.optimizers, names), names)
        if self.distributed:
            from .distributed import GradientSync, check_same_plan

            check_same_plan(plan)
            order = sorted(
                (k for k, opt in optimizers.items() if opt is not None),
                key=lambda k: (-k[0], k[1]),
            )
            self.sync = GradientSync(order)
        self.plan, self.optimizers, self._graph_cache = plan, optimizers, None
        for pool in [b.pool for b in self.backends if b.pool is not None] + [self.host_pool]:
            pool.clear()  # sized for the old plan's buffers
        for gpu in range(1, plan.n_gpus):  # made now, while no step is swapping weights in
            for index in range(len(self.layers)):
                self.replica(gpu, index)

    def _params_per_update(self, plan: Plan) -> dict[tuple[int, int], list[nn.Parameter]]:
        """The parameters each CPU update steps: (pack, shard) -> parameters.

        Data parallel over k GPUs splits a pack into k shards of whole layers (see
        :func:`~harmony.plan.layer_shard`). A parameter shared by layers
        in several packs (tied weights) belongs to the pack that runs backward
        last, the one with the lowest layers: the packs before it only add their
        gradient to the host copy, so it is stepped once, with the sum."""
        k = update_shards(plan)
        units = [
            ((q, r), layer_shard(pack, r, k))
            for q, pack in enumerate(plan.bwd_packs)
            for r in range(k)
        ]
        owner: dict[int, tuple[int, int]] = {}
        for key, layers in units:
            for i in layers:
                for p in self.layers[i].parameters():
                    if id(p) in owner and owner[id(p)][0] == key[0] and owner[id(p)] != key:
                        raise HarmonyError(
                            "tied weights inside one backward pack are not supported with data "
                            "parallel updates; put the tied layers in different packs or use "
                            "harmony-pp"
                        )
                    owner.setdefault(id(p), key)
        out: dict[tuple[int, int], list[nn.Parameter]] = {}
        for key, layers in units:
            seen: set[int] = set()
            out[key] = [
                p
                for i in layers
                for p in self.layers[i].parameters()
                if owner[id(p)] == key and not (id(p) in seen or seen.add(id(p)))
            ]
        return out

    def split_ties(self, start: int, stop: int) -> list[tuple[int, str, nn.Parameter]]:
        """The parameters that layers [start, stop) share with layers outside it,
        each as (layer, name) of its first use inside, and the parameter."""
        found = self._split_ties.get((start, stop))
        if found is None:
            found = []
            for uses in self.tied.values():
                inside = [(i, name) for i, name in uses if start <= i < stop]
                if inside and len(inside) < len(uses):
                    i, name = inside[0]
                    found.append((i, name, self.host_params[i][name]))
            self._split_ties[(start, stop)] = found
        return found

    def replica(self, gpu: int, index: int) -> nn.Module:
        """Layer ``index`` to run on GPU ``gpu``: the host module on the first GPU, a
        weightless copy on the others (``functional_call`` swaps the weights of the
        module it runs, so two GPUs must not run the same module object)."""
        if gpu == 0:
            return self.layers[index]
        with self._replica_lock:
            module = self._replicas.get((gpu, index))
            if module is None:
                module = weightless_copy(self.layers[index])
                self._replicas[(gpu, index)] = module
            return module

    def _graph(self, inputs: tuple, target: torch.Tensor) -> TaskGraph:
        if self.spec is None:
            planned = (
                []
                if self.plan is None
                else [
                    b - a
                    for mbs in (self.plan.fwd_microbatches(), self.plan.bwd_microbatches())
                    for a, b in mbs
                ]
            )
            self.spec = describe(
                self.layers,
                inputs,
                target,
                name=type(self.model).__name__,
                loss_fn=self.loss_fn,
                device=self.backend.torch_device,
                dtype=self.compute_dtype,
                sizes=planned,
            )
            if self.profile is not None:
                check_same_sizes(self.profile, self.spec)
        if self.plan is None:
            from .planning import auto_plan

            self.set_plan(auto_plan(self, inputs, target))
        if self._graph_cache is None:
            smallest = min(
                b - a
                for mbs in (self.plan.fwd_microbatches(), self.plan.bwd_microbatches())
                for a, b in mbs
            )
            if smallest < self.spec.min_microbatch:
                raise HarmonyError(
                    f"plan {self.plan.describe()} runs microbatches of {smallest} sample(s), but "
                    f"this model trains on {self.spec.min_microbatch} at least (a BatchNorm over "
                    "features needs more than one value per channel): use larger microbatches (a "
                    "divisor of the minibatch)"
                )
            # the profile has the same sizes as the description, and times: the play
            # that fixes the memory order then resembles the run
            graph = build_graph(self.profile or self.spec, self.hardware(), self.plan)
            check_host_memory(self, graph)
            self._graph_cache = graph
            # buffers are admitted on the devices in the simulator's order: the engine's
            # peak is then the simulated one, whatever the timing (no memory to manage
            # on the cpu backend)
            managed = any(b.copies for b in self.backends)
            self._memory_order = play(graph).order if managed else None
        return self._graph_cache

    # ---- one step -----------------------------------------------------------------
    def _check_like_first(self, inputs: tuple, target: torch.Tensor) -> None:
        """Every minibatch must look like the first (the plan and the graph were
        made for its shapes); say so before anything runs."""
        kinds = _kinds(inputs, target)
        first = self._batch_kinds
        if first is not None and kinds != first:

            def show(ks):
                return ", ".join(
                    f"[B, {', '.join(map(str, shape))}] {dtype}" for shape, dtype in ks
                )

            raise HarmonyError(
                f"this minibatch's inputs and target are {show(kinds)}, but the engine was set up "
                f"for {show(first)}; give every step minibatches of the same shapes and dtypes"
            )

    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous SGD iteration over a minibatch; returns its mean loss."""
        from .step import StepRun

        inputs = as_args(inputs)
        if not isinstance(target, torch.Tensor) or not all(
            isinstance(t, torch.Tensor) for t in inputs
        ):
            given = ", ".join(type(t).__name__ for t in (*inputs, target))
            raise HarmonyError(
                f"step(inputs, target) takes torch tensors (inputs: a tensor or a tuple of "
                f"tensors), got {given}; convert with torch.as_tensor"
            )
        if target.shape[0] != self.minibatch_size or any(
            t.shape[0] != self.minibatch_size for t in inputs
        ):
            raise HarmonyError(
                f"expected a minibatch of {self.minibatch_size} samples (dimension 0), got inputs "
                f"{[tuple(t.shape) for t in inputs]} and target {tuple(target.shape)}"
            )
        self._check_like_first(inputs, target)
        graph = self._graph(inputs, target)
        if self._batch_kinds is None:  # the model ran on it: later minibatches must look the same
            self._batch_kinds = _kinds(inputs, target)
        if self.sync is not None:
            self.sync.start_step()
        run = StepRun(self, graph, inputs, target, memory_order=self._memory_order)
        try:
            run.execute()
        except NonFiniteError as caught:
            run.roll_back()
            err = caught
            if run.poisoned is not None:
                # every server finds a non-finite gradient; this one says why
                err = NonFiniteError(
                    f"{run.poisoned} on this server; averaged into every server's gradient, "
                    "so every server skips the step",
                    "gradient",
                )
            if self.loss_scale != 1.0 and err.what == "gradient":
                # fp16 overflow: a smaller scale next time
                self.loss_scale /= 2
                self.good_steps = 0
            elif self.nonfinite == "raise":
                raise err from None
            else:
                warnings.warn(
                    f"step {self.step_count} skipped, weights unchanged: {err}", stacklevel=2
                )
            self.step_count += 1
            self.skipped_steps += 1
            return float("nan")
        except BaseException:
            run.roll_back()
            raise
        self.step_count += 1
        if self.loss_scale != 1.0:
            self.good_steps += 1
            if self.good_steps == GROWTH_INTERVAL:
                self.loss_scale *= 2
                self.good_steps = 0
        self.trace = run.trace()
        return run.loss

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue this run: host weights and buffers,
        optimizer state (per parameter name), step counter, seed, torch's random
        state, plan. Tensors are the live ones, as ``nn.Module.state_dict`` gives."""
        return engine_state(self)

    def load_state_dict(self, state: dict, plan: Plan | None = None) -> None:
        """Continue the run ``state`` was taken from. The plan is ``plan``, else the
        engine's own, else the one in ``state``. Checked before anything changes."""
        self._continue(state, plan, "the state")

    def _continue(self, state: dict, plan: Plan | None, source: str) -> None:
        check_state(self, state, source)
        if plan is None and self.plan is None and state["plan"] is not None:
            plan = Plan.from_dict(state["plan"])
        apply_state(self, state, plan)

    def save(self, path) -> Path:
        """Write a checkpoint to ``path`` atomically (a crash never leaves a half-written file)."""
        return write_checkpoint(path, self.state_dict())

    @classmethod
    def load(
        cls,
        path,
        model,
        optimizer: Callable,
        loss_fn: Callable,
        device="cpu",
        plan: Plan | None = None,
        **kwargs,
    ) -> "Engine":
        """An engine that continues the run saved in ``path`` with ``model`` (built
        the same way as the saved one; its weights are overwritten), the same
        minibatch size and seed, and the saved plan unless ``plan`` is given."""
        state = read_checkpoint(path)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path} is a checkpoint but not of an engine's state")
        kwargs.setdefault("precision", state["precision"])
        engine = cls(
            model,
            optimizer,
            loss_fn,
            device=device,
            minibatch_size=state["minibatch_size"],
            plan="auto",
            seed=state["seed"],
            **kwargs,
        )
        engine._continue(state, plan, str(path))
        return engine


def check_on_host(layers: list[nn.Module]) -> None:
    """The model is the host copy of the weights: its tensors must be real and in
    host memory."""
    for i, layer in enumerate(layers):
        for name, t in (*layer.named_parameters(), *layer.named_buffers()):
            if t.device.type == "meta":
                raise HarmonyError(
                    f"layer {i} ({type(layer).__name__}) has {name} on the meta device, which "
                    "holds no values: build the model on the CPU (e.g. harmony.zoo.build(name, "
                    "device='cpu')) or load its weights first (module.to_empty(device='cpu') and "
                    "a state_dict)"
                )
            if t.device.type != "cpu":
                raise HarmonyError(
                    f"layer {i} ({type(layer).__name__}) has {name} on {t.device}: the engine "
                    "keeps the model in host memory and moves packs to the devices itself; pass "
                    "the model on the CPU (model.to('cpu')) and the GPUs as device="
                )


def check_same_sizes(given: ModelSpec, described: ModelSpec) -> None:
    """A cost model given to the engine must be of its chain, in its precision."""
    if len(given) != len(described):
        raise HarmonyError(
            f"the spec given has {len(given)} layers but the model has {len(described)}: "
            "give the spec harmony.profile made of this model's layers"
        )
    for i, (a, b) in enumerate(zip(given.layers, described.layers)):
        if (given.weight_bytes(i, i + 1), given.input_bytes(i, 1)) != (
            described.weight_bytes(i, i + 1),
            described.input_bytes(i, 1),
        ):
            raise HarmonyError(
                f"layer {i} of the spec given ({a.name}) has other sizes than the model's "
                f"({b.name}): {given.weight_bytes(i, i + 1)} vs "
                f"{described.weight_bytes(i, i + 1)} bytes of weights, {given.input_bytes(i, 1)} "
                f"vs {described.input_bytes(i, 1)} bytes of input per sample; give the spec "
                "harmony.profile made of this model, in the engine's precision"
            )


def check_optimizer_holds(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """The optimizer a factory made must step exactly the parameters it was given
    (one optimizer per pack): one built over ``model.parameters()`` would step
    every weight once per pack."""
    given = {id(p) for p in params}
    held = optimizer_params(opt)
    foreign = sum(1 for p in held if id(p) not in given)
    missing = len(given - {id(p) for p in held})
    if foreign or missing or len(held) != len({id(p) for p in held}):
        raise HarmonyError(
            f"the optimizer factory was given {len(given)} parameters but built an optimizer over "
            f"{len(held)} ({foreign} not among those given, {missing} of those given left out): "
            "build it over the parameters passed in, e.g. lambda params: "
            "torch.optim.AdamW(params, lr=3e-4), not over model.parameters()"
        )


def weightless_copy(layer: nn.Module) -> nn.Module:
    """``layer`` with every parameter and buffer replaced by a tensor on the meta
    device, shared where the layer shares it: a parameter that two submodules
    hold (tied weights inside one layer) stays one parameter, so
    ``functional_call`` ties both names to the one device tensor it is given.
    Nothing is copied (``deepcopy`` then ``.to("meta")`` would copy every weight
    and untie shared ones)."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)


def _kinds(inputs: tuple, target: torch.Tensor) -> tuple:
    """Per-sample shapes and dtypes of a minibatch."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in (*inputs, target))
