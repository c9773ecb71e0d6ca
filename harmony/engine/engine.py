"""The engine: train a chain of layers with the task graph of a plan, for real.

Host memory holds the master weights (the user's model itself), their
gradients and the optimizer state; one optimizer per backward pack (per
shard of a pack in data parallel) runs on the CPU, or, for a swapping
baseline's ``gpu_optimizer``, on each GPU that runs the pack, between its
state coming in and going out. The devices hold only what the graph puts
there: a pack's weights while it runs, its gradient accumulator,
activations in flight, stashed inputs brought back for recompute, and
optimizer state while it is stepped there. Every step plays the plan's
TaskGraph (see :mod:`.step.run`), one thread per lane, and records a
:class:`~harmony.trace.Trace` with the simulator's schema.

Exactness (bitwise equal to the plain loop, for which plans): see
:mod:`harmony.engine.reference_loop`.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, NonFiniteError
from ..graph import TaskGraph
from ..plan import Plan
from ..simulate import simulate_graph
from ..trace import Trace
from .auto_plan import Searched, auto_plan
from .checkpoint import write_checkpoint
from .checkpoint_state import (
    HeldState,
    carried_over,
    check_state,
    load_state,
    model_weights,
    read_run_state,
    resumed,
    run_arguments,
    run_state_dict,
)
from .context import StepContext
from .decompose import decompose
from .describe import describe_chain, norm_tensor_names
from .devices import Backend, make_backends
from .disk_setup import HostSettings, host_settings
from .disk_staging import StateOnDisk
from .distributed import broadcast_weights, gradient_sync_for
from .gradient_slots import GradientSlots
from .host_graphs import HostGraphs
from .host_memory import KeptOnHost, besides_the_model
from .host_model import HostModel, params_per_update
from .journal import UpdateJournal, optimizer_kind
from .lazy_weights import UnmadeWeights
from .placing import lay_out_weights, place_state
from .reference_loop import as_args
from .refusals import (
    PRECISIONS,
    batch_kinds,
    check_arguments,
    check_batch,
    check_microbatches,
    check_plan,
    check_same_sizes,
    resolve_distributed,
)
from .run_state import RunState, run_field
from .step import StepRun


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

    ``host_memory``: the process's host memory budget (bytes or ``"8GB"``;
    default: the given ``hardware``'s, at most what this process holds and the
    machine has free), charged to a ledger (``host_settings.budget``) as
    :mod:`.disk_setup` says, so the process's peak resident memory stays under
    it. Training state that does not fit goes to a disk tier in ``disk_dir``
    (optimizer state first, then master weights, last pack first;
    :mod:`harmony.policies.disk_tier`), read and written around each update
    and weight load, crash-safe. ``disk``: the disk link's bandwidth,
    ``"200MB/s,200MB/s"`` (``",shared"`` after them: reads and writes share the
    disk's time) or a name (``"nvme"``): the tier is paced to it, an emulated
    disk; default: the ``hardware``'s, else measured in ``disk_dir`` when the
    state needs it. Call :meth:`close` when done with an engine that has a disk tier.

    A model too large to build in host memory: build it under
    :func:`~harmony.engine.lazy_weights.empty_weights` (parameters on the meta
    device) and the engine makes its weights at the first step where they live,
    those on the disk tier one update at a time (never all in memory), each
    layer by its modules' ``reset_parameters()`` then ``init(layer)``, seeded by
    ``seed`` and the layer's index; :func:`~harmony.engine.lazy_weights.materialize`
    makes the same values in memory.

    Checkpoints: :meth:`save` / :meth:`load` (atomic, checksummed files) and
    :meth:`state_dict` / :meth:`load_state_dict`. A run resumed from a
    checkpoint continues bitwise as if it had never stopped. With a disk
    tier, :meth:`save` refers to the tier's state instead of copying it, and
    :meth:`load` reopens the tier as of the checkpoint's step.
    """

    step_count = run_field("step_count")
    skipped_steps = run_field("skipped_steps")
    loss_scale = run_field("loss_scale")
    good_steps = run_field("good_steps")
    seed = run_field("seed")
    precision = run_field("precision")
    minibatch_size = run_field("minibatch_size")
    plan = run_field("plan")

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
        host_memory: str | int | None = None,
        disk_dir: str | Path | None = None,
        disk: str | tuple | None = None,
        init: Callable | None = None,
    ):
        check_arguments(
            optimizer, loss_fn, minibatch_size, seed, nonfinite, precision, spec, hardware
        )
        self.host_settings = host_settings(host_memory, disk_dir, disk, hardware)
        self.disk: StateOnDisk | None = None  # the state on the disk tier, once placed
        self.gradient_slots: GradientSlots | None = None  # host gradients in slots, if placed so
        self.chain = decompose(model)
        self.layers: list[nn.Module] = list(self.chain.layers)
        self.model = model
        # parameters on the meta device: made where they live at the first step
        self.unmade = UnmadeWeights.of(model, self.layers, init, seed)
        # the module whose state_dict holds every host weight and buffer
        self.host_module = model if isinstance(model, nn.Module) else nn.ModuleList(self.layers)
        self.loss_fn, self.device = loss_fn, device
        self.backends: list[Backend] = make_backends(device)
        # host weights in flat buffers, page-locked for a GPU (see HostModel)
        gpu = any(b.kind == "cuda" for b in self.backends)
        # with a budget, the weights are laid out once the disk tier has taken its share
        # (laying out all of them first would hold them twice), and unmade ones once made
        flatten = host_memory is None and self.unmade is None
        self.host = HostModel(self.layers, self.host_module, pin=gpu, flatten=flatten)
        self.keep_casts = gpu and host_memory is None  # see StepContext.keep_casts
        # BatchNorm's parameters and statistics keep their dtype under mixed precision
        self.norm_tensors = [norm_tensor_names(layer) for layer in self.layers]
        self.rng_lock = threading.Lock()
        # fp16: dynamic loss scaling as torch.amp.GradScaler does it (an overflowing
        # step is skipped and the scale halved; it doubles after GROWTH_INTERVAL good steps)
        self.run_state = RunState(
            seed, minibatch_size, precision, loss_scale=2.0**16 if precision == "fp16" else 1.0
        )
        self.safe_updates, self.nonfinite = safe_updates, nonfinite
        self.journal = UpdateJournal(ahead=gpu)  # what a step's updates change, to undo
        self.compute_dtype: torch.dtype | None = PRECISIONS[precision]
        self.trace: Trace | None = None
        self._optimizer_factory = optimizer
        self.spec = None  # sizes of the chain, from the first minibatch
        # the cost model with times the graph is played with (the memory order): given,
        # or measured when plan="auto" profiles; None: the sizes, with FLOP-rate times
        self.profile = spec
        self.graphs = HostGraphs(device, hardware, self.host_settings, self.backends, safe_updates)
        # (pack, shard) -> the optimizer of those parameters
        self.optimizers: dict[tuple[int, int], torch.optim.Optimizer | None] = {}
        self._graph_cache: TaskGraph | None = None
        self._memory_order: dict | None = None  # of the cached graph's buffers, per device
        self._batch_kinds: tuple | None = None  # shapes and dtypes of the first minibatch
        self.distributed = resolve_distributed(distributed, disk_dir, self.unmade)
        self.sync = None  # GradientSync across servers, once a plan is set
        if self.distributed:
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
        calibrated on this machine (:func:`~harmony.engine.calibrate.calibrate`),
        with the engine's host memory budget and disk tier (where its bandwidth
        is known)."""
        if self.graphs.running is not None:  # what the graph was built for
            return self.graphs.running
        return self.graphs.before_plan(besides_the_model(self.host_module))

    def host_graph(
        self, plan: Plan, settings: HostSettings, profile: ModelSpec | None = None
    ) -> tuple[TaskGraph, Hardware]:
        """The graph of ``plan`` with the host memory and disk tier of
        ``settings`` (:func:`~harmony.engine.disk_setup.build_for_host`), and the
        hardware it was built for; :class:`HostMemoryError` if it cannot fit.
        ``profile``: the chain's times to play it with (default: the engine's).
        With the engine's own settings, the last one built is kept for the first
        step of that plan (``plan="auto"`` builds it to check that it fits)."""
        kept = self.graphs.kept(plan, settings)
        if kept is not None:
            return kept
        updates = params_per_update(self.host, plan).values()
        spec = profile or self.profile or self.spec  # the profile's times, where there is one
        base = self.graphs.base()
        most = max((len(ps) for ps in updates), default=0)
        return self.graphs.build(
            plan, settings, spec, base, most, besides_the_model(self.host_module)
        )

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
        if self.disk is not None:
            raise HarmonyError(
                "the plan of a run with state on a disk tier cannot change: its files are per "
                "pack of the plan it was placed for"
            )
        devices = [b.name for b in self.backends]
        check_plan(
            plan, self.layers, devices, self.minibatch_size, self.precision, self.distributed
        )
        units = params_per_update(self.host, plan)
        optimizers = carried_over(
            self._optimizer_factory, units, self.optimizers, self.host_module
        )
        if self.distributed:
            self.sync = gradient_sync_for(plan, optimizers)
        self.plan, self.optimizers, self._graph_cache = plan, optimizers, None
        self.graphs.running = None
        for pool in [b.pool for b in self.backends if b.pool is not None] + [self.host.pool]:
            pool.clear()  # sized for the old plan's buffers
        self.host.make_replicas(range(1, plan.n_gpus))

    def step_context(self) -> StepContext:
        """What the next step reads of this engine."""
        return StepContext(
            host=self.host,
            backends=self.backends,
            plan=self.plan,
            optimizers=self.optimizers,
            loss_fn=self.loss_fn,
            model_name=type(self.model).__name__,  # the name its spec is described with
            compute_dtype=self.compute_dtype,
            norm_tensors=self.norm_tensors,
            loss_scale=self.loss_scale,
            seed=self.seed,
            step=self.step_count,
            rng_lock=self.rng_lock,
            journal=self.journal if self.safe_updates else None,
            sync=self.sync,
            disk=self.disk,
            gradient_slots=self.gradient_slots,
            keep_casts=self.keep_casts and self.disk is None,
        )

    def kept_on_host(self) -> KeptOnHost:
        """What the engine keeps in host memory for its plan (see :mod:`.host_memory`)."""
        return KeptOnHost(
            self.host, self.optimizers, self.unmade, self.spec, self.plan, self.backends
        )

    def _held(self) -> HeldState:
        """The tensors a checkpoint of this run is made of (see :mod:`.checkpoint_state`)."""
        return HeldState(
            self.host_module, self.optimizers, self.disk, self.host_settings.resume, self.unmade
        )

    def _searched(self) -> Searched:
        """What ``plan="auto"`` searches a plan for (see :mod:`.auto_plan`)."""
        return Searched(
            layers=self.layers,
            loss_fn=self.loss_fn,
            optimizer=self._optimizer_factory,
            backends=self.backends,
            minibatch_size=self.minibatch_size,
            dtype=self.compute_dtype,
            safe_updates=self.safe_updates,
            distributed=self.distributed,
            spec=self.spec,
            profile=self.profile,
            host_settings=self.host_settings,
            host_module=self.host_module,
            hardware=self.hardware,
            params_per_update=partial(params_per_update, self.host),
            host_graph=lambda plan, profile: self.host_graph(plan, self.host_settings, profile),
        )

    def _graph(self, inputs: tuple, target: torch.Tensor) -> TaskGraph:
        if self.spec is None:
            self.spec = describe_chain(
                self.layers,
                inputs,
                target,
                type(self.model).__name__,
                optimizer_kind(self._optimizer_factory),
                self.loss_fn,
                self.backend.torch_device,
                self.compute_dtype,
                self.plan,
            )
            if self.profile is not None:
                check_same_sizes(self.profile, self.spec)
                # the state the engine's optimizer keeps, whatever the profile assumed
                self.profile = replace(self.profile, optimizer=self.spec.optimizer)
        if self.plan is None:
            plan, self.profile = auto_plan(self._searched(), inputs, target)
            self.set_plan(plan)
        if self._graph_cache is None:
            self._place(self.plan)
        return self._graph_cache

    def _place(self, plan: Plan) -> None:
        """Build the graph of ``plan`` for the host memory and place its state
        (:func:`~harmony.engine.placing.place_state`)."""
        check_microbatches(plan, self.spec)
        # the profile has the same sizes as the description, and times: the play
        # that fixes the memory order then resembles the run
        graph, server = self.host_graph(plan, self.host_settings)
        self.graphs.run(plan, graph, server)
        placed = place_state(
            graph,
            plan,
            self.kept_on_host(),
            self.host_settings,
            self.safe_updates,
            self.host_module,
            self.step_count,
        )
        self.disk, self.gradient_slots = placed.disk, placed.gradient_slots
        self._graph_cache = graph
        self._memory_order = placed.memory_order

    def lay_out_weights(self) -> None:
        """Lay the host weights out in flat buffers and make the unmade ones (see
        :func:`~harmony.engine.placing.lay_out_weights`)."""
        lay_out_weights(self.kept_on_host())

    # ---- one step -----------------------------------------------------------------
    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous SGD iteration over a minibatch; returns its mean loss."""
        inputs = as_args(inputs)
        check_batch(inputs, target, self.minibatch_size, self._batch_kinds)
        graph = self._graph(inputs, target)
        if self._batch_kinds is None:  # the model ran on it: later minibatches must look the same
            self._batch_kinds = batch_kinds(inputs, target)
        if self.sync is not None:
            self.sync.start_step()
        run = StepRun(self.step_context(), graph, inputs, target, memory_order=self._memory_order)
        try:
            run.execute()
            if self.disk is not None:  # what the step wrote to disk becomes its state
                self.disk.tier.commit(self.step_count + 1)
        except NonFiniteError as caught:
            run.roll_back()
            self.run_state.skipped(run.reported(caught), self.nonfinite)
            if self.disk is not None:  # the tier's state is unchanged, as of this step too
                self.disk.tier.commit(self.step_count)
            return float("nan")
        except BaseException:
            if run.roll_back():  # past its point of no return: completed, not undone
                self.run_state.stepped()
                self.trace = None
            raise
        self.run_state.stepped()
        self.trace = run.trace()
        return run.loss

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self, referenced: bool = False) -> dict:
        """Everything needed to continue this run: host weights and buffers,
        optimizer state (per parameter name), step counter, seed, torch's random
        state, plan. Tensors are the live ones, as ``nn.Module.state_dict`` gives.
        ``referenced``: state on a disk tier is referred to (the tier as of this
        step, what :meth:`save` writes; continue it with :meth:`load`), not read."""
        overhead = self.hardware().task_overhead_s  # informative: recalibrated on load
        return run_state_dict(self.run_state, self._held(), overhead, referenced)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and buffers (copies, ``state_dict`` names), master
        weights on the disk tier read back: what to keep of a finished run."""
        return model_weights(self._held())

    def load_state_dict(self, state: dict, plan: Plan | None = None) -> None:
        """Continue the run ``state`` was taken from. The plan is ``plan``, else the
        engine's own, else the one in ``state``. Checked before anything changes."""
        if self.disk is not None:
            raise HarmonyError(
                "this engine keeps state on a disk tier: a run continues on another engine "
                "(Engine.load)"
            )
        self._continue(state, plan, "the state")

    def _continue(self, state: dict, plan: Plan | None, source: str) -> None:
        check_state(self.run_state, self._held(), state, source)
        if plan is None and self.plan is None and state["plan"] is not None:
            plan = Plan.from_dict(state["plan"])
        if plan is not None:
            self.set_plan(plan)
        load_state(self._held(), state)
        self.run_state = resumed(self.run_state, state)

    def save(self, path) -> Path:
        """Write a checkpoint to ``path`` atomically (a crash never leaves a half-written file);
        state on a disk tier is referred to (the tier as of this step), not copied."""
        return write_checkpoint(path, self.state_dict(referenced=True))

    def close(self) -> None:
        """Stop the disk tier's I/O threads and give its buffers back (the engine
        cannot step afterwards)."""
        if self.disk is not None:
            self.disk.close()

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
        the same way as the saved one; its weights are overwritten: built under
        :func:`~harmony.engine.lazy_weights.empty_weights`, they are never made,
        only read from the checkpoint and the tier), the same minibatch size and
        seed, and the saved plan unless ``plan`` is given."""
        state = read_run_state(path)
        kwargs = {**run_arguments(state), **kwargs}
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
        if "disk" in state:
            engine.host_settings.resume = {**state["disk"], "step": state["step"]}
        engine._continue(state, plan, str(path))
        return engine
