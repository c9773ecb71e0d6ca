"""The engine: train a chain of layers with the task graph of a plan, for real.

Host memory holds the master weights (the user's model itself), their
gradients and the optimizer state; one optimizer per backward pack (per
shard of a pack in data parallel) runs on the CPU, or, for a swapping
baseline's ``gpu_optimizer``, on each GPU that runs the pack, between its
state coming in and going out. The devices hold only what the graph puts
there: a pack's weights while it runs, its gradient accumulator,
activations in flight, stashed inputs brought back for recompute, and
optimizer state while it is stepped there. Every step plays the plan's
TaskGraph (see :mod:`.step`), one thread per lane, and records a
:class:`~harmony.trace.Trace` with the simulator's schema.

Exactness: with equal forward and backward microbatch sizes in float32, the
weights after any number of steps are bitwise identical to
:func:`~harmony.engine.reference_loop.reference_step` on one device and with
harmony-pp, gpipe-swap or model-parallel on several; harmony-dp sums
gradients across GPUs in another order (allclose), and so does layer-swap
unless its gradient sums stay on the GPUs (``gpu_gradients``: each replica's
sum, then their sum in GPU order, deterministic).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..errors import HarmonyError, NonFiniteError
from ..graph import TaskGraph
from ..plan import Plan
from ..policies import STATE_OPTIONS, update_shards
from ..simulate import play, simulate_graph
from ..trace import Trace
from .calibrate import calibrate
from .checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from .context import StepContext
from .decompose import decompose
from .describe import describe, norm_tensor_names
from .devices import Backend, make_backends
from .disk_setup import HostSettings, attach, build_for_host, host_settings
from .disk_staging import StateOnDisk
from .refusals import (
    PRECISIONS,
    batch_kinds,
    check_arguments,
    check_batch,
    check_plan,
    check_same_sizes,
    check_updates_run_where_state_is,
    make_optimizers,
)
from .gradient_slots import GradientSlots, gradient_slots_for
from .host_memory import besides_the_model, check_host_memory
from .host_model import HostModel
from .lazy_weights import UnmadeWeights
from .reference_loop import as_args
from .checkpoint_state import FORMAT as STATE_FORMAT
from .checkpoint_state import (
    apply_state,
    check_state,
    engine_state,
    load_optimizer_state,
    model_weights,
    optimizer_state,
    param_names,
)
from .journal import UpdateJournal, optimizer_kind

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

    ``host_memory``: the process's host memory budget (bytes or ``"8GB"``;
    default: the given ``hardware``'s, at most what this process holds and the
    machine has free). What the process holds besides the model (measured when
    the first step is planned) and the device memory of the cpu and emulated
    backends (host memory too) come out of it first; the rest is for what the
    engine keeps there: training state, stashes and offloaded activations, the
    update journal and the disk tier's buffers, all charged to a ledger
    (``host_settings.budget``), and freed tensors go back to the system, so
    the process's peak resident memory stays under the budget. Training
    state that does not fit goes to a disk tier in ``disk_dir`` (optimizer
    state first, then master weights, last pack first;
    :mod:`harmony.policies.disk_tier`), read and written around each update
    and weight load, crash-safe: see :mod:`.disk_setup`. ``disk``: the disk
    link's bandwidth, ``"200MB/s,200MB/s"`` (``",shared"`` after them: reads
    and writes share the disk's time) or a name (``"nvme"``): the tier is
    paced to it, an emulated disk; default: the ``hardware``'s, else measured
    in ``disk_dir`` when the state needs it (whether reads and writes share
    its time included). Call :meth:`close` when
    done with an engine that has a disk tier.

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
        self.loss_fn = loss_fn
        self.device = device
        self.backends: list[Backend] = make_backends(device)
        # host weights in flat buffers, page-locked for a GPU (see HostModel)
        gpu = any(b.kind == "cuda" for b in self.backends)
        # with a budget, the weights are laid out once the disk tier has taken its share
        # (laying out all of them first would hold them twice), and unmade ones once made
        flatten = host_memory is None and self.unmade is None
        self.host = HostModel(self.layers, self.host_module, pin=gpu, flatten=flatten)
        # BatchNorm's parameters and statistics keep their dtype under mixed precision
        self.norm_tensors = [norm_tensor_names(layer) for layer in self.layers]
        self.rng_lock = threading.Lock()
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.safe_updates = safe_updates
        # what a step's updates changed, to undo it if the step fails
        self.journal = UpdateJournal()
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
        self.spec = None  # sizes of the chain, from the first minibatch
        # the cost model with times the graph is played with (the memory order): given,
        # or measured when plan="auto" profiles; None: the sizes, with FLOP-rate times
        self.profile = spec
        self._hardware = hardware
        # (pack, shard) -> the optimizer of those parameters
        self.optimizers: dict[tuple[int, int], torch.optim.Optimizer | None] = {}
        self._graph_cache: TaskGraph | None = None
        self._graph_hardware: Hardware | None = None  # the server the cached graph is for
        self._host_graph: tuple | None = None  # (plan, host_graph's result) not yet run
        self._memory_order: dict | None = None  # of the cached graph's buffers, per device
        self._batch_kinds: tuple | None = None  # shapes and dtypes of the first minibatch
        if distributed is None:
            distributed = (
                torch.distributed.is_available()
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1
            )
        self.distributed = distributed
        if distributed and disk_dir is not None:
            raise HarmonyError("the disk tier runs on one server: disk_dir with distributed")
        if distributed and self.unmade is not None:
            raise HarmonyError(
                "a model with parameters on the meta device trains on one server: build it on "
                "the CPU to train it across servers"
            )
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
        calibrated on this machine (:func:`~harmony.engine.calibrate.calibrate`),
        with the engine's host memory budget and disk tier (where its bandwidth
        is known)."""
        if self._graph_hardware is not None:  # what the graph was built for
            return self._graph_hardware
        # before a plan: the budget less what the process holds besides the model
        # (what its devices take of host memory depends on the plan: host_graph)
        settings = self.host_settings
        besides = besides_the_model(self.host_module)
        hw = self._base_hardware().with_host_memory(max(1, settings.budget.capacity - besides))
        known = settings.directory is not None and settings.rates is not None
        return hw.with_disk(settings.rates if known else None)

    def host_graph(self, plan: Plan, settings: HostSettings) -> tuple[TaskGraph, Hardware]:
        """The graph of ``plan`` with the host memory and disk tier of
        ``settings`` (:func:`~harmony.engine.disk_setup.build_for_host`), and the
        hardware it was built for; :class:`HostMemoryError` if it cannot fit.
        With the engine's own settings, the last one built is kept for the first
        step of that plan (``plan="auto"`` builds it to check that it fits)."""
        own = settings is self.host_settings
        if own and self._host_graph is not None and self._host_graph[0] == plan:
            return self._host_graph[1]
        updates = self._params_per_update(plan).values()
        built = build_for_host(
            self.profile or self.spec,  # the profile's times, where there is one
            self._base_hardware(),
            plan,
            settings,
            max((len(ps) for ps in updates), default=0),
            self.safe_updates,
            besides_the_model(self.host_module),
            self.backends,
        )
        if own:
            self._host_graph = (plan, built)
        return built

    def _base_hardware(self) -> Hardware:
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
        if self.disk is not None:
            raise HarmonyError(
                "the plan of a run with state on a disk tier cannot change: its files are per "
                "pack of the plan it was placed for"
            )
        devices = [b.name for b in self.backends]
        check_plan(
            plan, self.layers, devices, self.minibatch_size, self.precision, self.distributed
        )
        optimizers = make_optimizers(self._optimizer_factory, self._params_per_update(plan))
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
        self._graph_hardware = None
        for pool in [b.pool for b in self.backends if b.pool is not None] + [self.host.pool]:
            pool.clear()  # sized for the old plan's buffers
        self.host.make_replicas(range(1, plan.n_gpus))

    def _params_per_update(self, plan: Plan) -> dict[tuple[int, int], list[nn.Parameter]]:
        """The parameters each update steps: (pack, shard) -> parameters (see
        :meth:`~harmony.engine.host_model.HostModel.update_params`). A plan that
        keeps gradient sums or the optimizer on the GPUs has one optimizer per
        pack, which every GPU that runs the pack steps whole (update_shards
        refuses those options, from before the engine ran them)."""
        on_gpus = any(plan.option(k) for k in STATE_OPTIONS)
        return self.host.update_params(plan, 1 if on_gpus else update_shards(plan))

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
        )

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
                optimizer=optimizer_kind(self._optimizer_factory),
                loss_fn=self.loss_fn,
                device=self.backend.torch_device,
                dtype=self.compute_dtype,
                sizes=planned,
            )
            if self.profile is not None:
                check_same_sizes(self.profile, self.spec)
                # the state the engine's optimizer keeps, whatever the profile assumed
                self.profile = replace(self.profile, optimizer=self.spec.optimizer)
        if self.plan is None:
            from .auto_plan import auto_plan

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
            graph, server = self.host_graph(self.plan, self.host_settings)
            self._host_graph = None
            check_updates_run_where_state_is(graph, self.plan)
            check_host_memory(self, graph)
            self.disk = attach(self, graph, self.host_settings, self.safe_updates)
            self.gradient_slots = gradient_slots_for(self, graph)
            self.host_settings.resume = None
            # master weights on the tier are placeholders now: lay out the rest anew
            on_disk = frozenset(self.disk.on_disk if self.disk is not None else ())
            self.lay_out_weights(on_disk)
            self._graph_cache, self._graph_hardware = graph, server
            # buffers are admitted on the devices in the simulator's order: the engine's
            # peak is then the simulated one, whatever the timing (on the cpu backend,
            # only where weight loads copy master weights read from disk)
            managed = any(b.copies for b in self.backends) or bool(on_disk)
            self._memory_order = play(graph).order if managed else None
        return self._graph_cache

    def lay_out_weights(self, on_disk: frozenset[int] = frozenset()) -> None:
        """Lay the host weights out in flat buffers, all but ``on_disk`` (ids of
        master weights a disk tier holds), if they are not yet or some left for the
        tier; then make the unmade ones (a model built on the meta device) in place."""
        if on_disk or not self.host.layout.flattened:
            self.host.layout.flatten(on_disk)
        if self.unmade is not None:
            self.unmade.make_all()

    # ---- one step -----------------------------------------------------------------
    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous SGD iteration over a minibatch; returns its mean loss."""
        from .step import StepRun

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
            if self.disk is not None:  # the tier's state is unchanged, as of this step too
                self.disk.tier.commit(self.step_count)
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
    def state_dict(self, referenced: bool = False) -> dict:
        """Everything needed to continue this run: host weights and buffers,
        optimizer state (per parameter name), step counter, seed, torch's random
        state, plan. Tensors are the live ones, as ``nn.Module.state_dict`` gives.
        ``referenced``: state on a disk tier is referred to (the tier as of this
        step, what :meth:`save` writes; continue it with :meth:`load`), not read."""
        return engine_state(self, referenced)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and buffers (copies, ``state_dict`` names), master
        weights on the disk tier read back: what to keep of a finished run."""
        return model_weights(self)

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
        check_state(self, state, source)
        if plan is None and self.plan is None and state["plan"] is not None:
            plan = Plan.from_dict(state["plan"])
        apply_state(self, state, plan)

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
        state = read_checkpoint(path)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path} is a checkpoint but not of an engine's state")
        kwargs.setdefault("precision", state["precision"])
        if "disk" in state:  # the run's state on disk is in its tier, as of the checkpoint
            kwargs.setdefault("disk_dir", state["disk"]["directory"])
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
