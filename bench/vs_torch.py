"""Harmony vs the best offload a PyTorch user can assemble from PyTorch itself.

A model whose training footprint (weights, gradients, two AdamW states,
activations) does not fit the device is trained by harmony (the best
harmony-pp plan on the measured profile) and by the recipe a PyTorch user
assembles for that situation from what PyTorch offers, :class:`TorchOffload`:

* weights and gradients stay on the device for the whole run;
* activation checkpointing on every layer (``torch.utils.checkpoint``,
  non-reentrant), with what the checkpoints save (each layer's input) sent to
  host memory as ``torch.autograd.graph.save_on_cpu`` does it: a synchronous
  copy out at the forward pass, a copy back when backward recomputes the layer;
* gradient accumulation over microbatches on the device, the microbatch size
  tuned as a user would: the fastest one that fits, trying sizes from the
  minibatch downward;
* after the last microbatch, gradients to the host, the optimizer step there
  on the float32 master weights (harmony's FlatAdamW, as the harmony run uses,
  so that only the offload strategy differs; torch.optim.AdamW too, on its own
  line), updated weights back to the device.

Everything runs on one thread, in order, as it does on one CUDA stream, which
is what this recipe gives without hand-written stream code: copies do not
overlap compute. The loss is computed inside the last layer's checkpoint, so
the logits are recomputed rather than sent to the host. The first step starts
from the same weights as harmony's and the bench prints how far apart the
updated weights are (the recipe computes the same training;
``tests/test_vs_torch.py`` checks it against a plain PyTorch step).

``--device emulated`` (the default) runs both on one emulated GPU, set up as
``bench/emulated.py`` does: a memory ledger with a hard capacity and links
paced so that compute : bandwidth matches a GTX 1080 Ti on PCIe 3.0. The
baseline runs on the same ledger capacity and paced links; its compute is the
same CPU's. Printed, measured in one run with the systems' steps interleaved
(drift in the machine's load hits all alike): samples/s and the ratio
harmony / baseline, host-link bytes per step and their ratio, peak device
memory against the capacity, and harmony's simulated iteration time. If the
baseline does not fit at any microbatch size, that is said, harmony runs alone,
and the comparison is repeated on a model with fewer blocks, whose weights and
gradients take at most half the device.

``--device cuda`` runs on the first GPU, its usable memory capped (``--memory``,
``torch.cuda.set_per_process_memory_fraction``) below the model's plain
training footprint: harmony, the same recipe with real copies through
page-locked memory, FSDP2 on one GPU with ``CPUOffloadPolicy`` (and
checkpointed layers), and DeepSpeed ZeRO-Offload (stage 2, optimizer on the
CPU) where ``deepspeed`` is installed. The systems run one after another (they
cannot share the capped memory). Printed per system: samples/s, the ratio to
harmony and model-FLOPs utilization (6 x parameters x tokens per step / step
time / the GPU's measured matmul FLOP/s). A system that fails prints why.

    python bench/vs_torch.py [--steps 6] [--hidden 256] [--blocks 6] [--minibatch 32] [--memory 56MB]
    python bench/vs_torch.py --device cuda [--precision bf16] [--hidden 2048] [--blocks 24] [--minibatch 8] [--memory 16GB]
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import math
import os
import socket
import statistics
import time
from dataclasses import replace
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import harmony
from emulated import FLOP_PER_BYTE_1080TI, cpu_flops
from harmony import EmulatedDevice, Engine, FlatAdamW
from harmony.engine.devices import Ledger, LinkPacer
from harmony.engine.planning import PLANNING_HEADROOM
from harmony.engine.profiler import default_sizes, measure_task_overhead, profile
from harmony.engine.reference_loop import as_args
from harmony.errors import OutOfMemoryError
from harmony.hardware import parse_bytes
from harmony.plan import split_samples
from harmony.search import search
from harmony.spec import ModelSpec
from harmony.training import build_model, lm_loss

#: out of device memory: the emulated ledger's error, or the CUDA allocator's
OOM = (OutOfMemoryError, torch.OutOfMemoryError)

DEFAULTS = {
    "emulated": dict(steps=6, hidden=256, blocks=6, minibatch=32, memory="56MB", seq_len=64, vocab=512),
    "cuda": dict(steps=3, hidden=2048, blocks=24, minibatch=8, memory="16GB", seq_len=1024, vocab=50257),
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def flat_adamw(params):
    return FlatAdamW(params, lr=1e-4)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


class TorchOffload:
    """The PyTorch-native offload recipe (see the module docstring), one step at a time.

    ``model``: the chain on the host; it stays the float32 master copy that
    ``optimizer(params)`` (one optimizer over all of them) updates.
    ``device``: an :class:`~harmony.EmulatedDevice` (copies are real copies
    paced to its links; a ledger with its capacity raises
    :class:`~harmony.errors.OutOfMemoryError`) or ``"cuda:N"`` (copies through
    page-locked host memory, as ``save_on_cpu(pin_memory=True)`` makes them;
    the ledger only counts). ``spec``: the chain's profile, for what one
    layer's recompute holds on the device (``bwd_extra``; None: not charged,
    as on a GPU, where the allocator holds the cap). ``autocast``: the
    compute dtype under ``torch.autocast`` (None: float32).

    Charged to the ledger: weights (parameters and buffers) and gradients, for
    the whole run; the microbatch's inputs and target; in the forward pass the
    input and output of the layer running (what a checkpoint saves is on the
    host); in the backward pass, for the layer being recomputed only, its input
    brought back, the gradient of its output and its recompute's saved
    activations (the profile's ``bwd_extra``). Transients inside one operator
    are not charged, as in harmony's ledger.

    Bytes over the host link per step (``moved``), in closed form:
    h2d = inputs + targets + saved + parameters, d2h = saved + parameters,
    where saved = the inputs of every layer for every sample of the minibatch
    (``sum(spec.input_bytes(i, minibatch))``)."""

    def __init__(self, model: nn.Sequential, optimizer: Callable, loss_fn: Callable, device,
                 microbatch_size: int, spec: ModelSpec | None = None, autocast: torch.dtype | None = None):
        self.emulated = isinstance(device, EmulatedDevice)
        self.torch_device = torch.device("cpu" if self.emulated else device)
        self.pin = not self.emulated
        self.rates = {"h2d": device.h2d_rate, "d2h": device.d2h_rate} if self.emulated else {}
        self.pacer = LinkPacer(self.rates) if self.emulated else None
        self.ledger = Ledger("gpu0", device.capacity if self.emulated else None)
        self.loss_fn, self.microbatch_size, self.spec, self.autocast = loss_fn, microbatch_size, spec, autocast
        self.layers = copy.deepcopy(model).to(self.torch_device)  # on the emulated device: a copy in host memory
        self.params = list(self.layers.parameters())
        self.ledger.charge(nbytes(self.params) * 2 + nbytes(self.layers.buffers()), "weights and gradients")
        self.master = list(model.parameters())
        if self.pin:
            for p in self.master:
                p.data = p.data.pin_memory()
        for p in self.master:  # gradients land in these host buffers at every step
            p.grad = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin)
        self.optimizer = optimizer(self.master)
        self.moved = {"h2d": 0, "d2h": 0}
        self.transient = 0.0  # bytes charged for the step in progress

    @property
    def peak_memory(self) -> float:
        """Peak device bytes of the last step."""
        return self.ledger.peak if self.emulated else torch.cuda.max_memory_allocated(self.torch_device)

    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous step over the minibatch; returns its loss."""
        inputs = as_args(inputs)
        total = target.shape[0]
        self.moved = {"h2d": 0, "d2h": 0}
        self.ledger.reset(time.perf_counter())
        if not self.emulated:
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        loss = 0.0
        try:
            for a, b in split_samples(total, self.microbatch_size):
                loss += self._microbatch(tuple(t[a:b] for t in inputs), target[a:b], (b - a) / total)
        except BaseException:
            self.layers.zero_grad(set_to_none=True)  # a failed step leaves no half-accumulated gradient
            raise
        finally:
            self._release(self.transient)
        self._update()
        return loss

    def _microbatch(self, inputs: tuple, target: torch.Tensor, scale: float) -> float:
        self.u = target.shape[0]
        h = tuple(self._to_device(t) for t in inputs)
        y = self._to_device(target)
        self._charge(nbytes(h) + nbytes(y), "microbatch")
        self.output_bytes: list[int] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        autocast = torch.autocast(self.torch_device.type, dtype=self.autocast, enabled=self.autocast is not None)
        with hooks, autocast:
            for i, layer in enumerate(self.layers):
                self.current = i
                if i == len(self.layers) - 1:
                    def fn(*args, layer=layer):
                        return self.loss_fn(*as_args(layer(*args)), y)
                else:
                    fn = layer
                out = as_args(checkpoint(fn, *h, use_reentrant=False))
                self._charge(nbytes(out), f"output of layer {i}")
                self._release(nbytes(h))
                self.output_bytes.append(nbytes(out))
                h = out
            loss = h[0] * scale
        self.recomputing, self.recompute_bytes = None, 0.0
        loss.backward()
        self._release(self.recompute_bytes + nbytes(h) + nbytes(y))
        return loss.item()

    def _pack(self, t: torch.Tensor):
        """save_on_cpu's pack: a synchronous copy to (page-locked) host memory."""
        started = time.perf_counter()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        host.copy_(t)
        self._paced("d2h", host, started)
        return self.current, host

    def _unpack(self, packed) -> torch.Tensor:
        """save_on_cpu's unpack, at the recompute of the checkpoint that saved it.
        Backward reaches the layers in reverse order, so the first unpack of a
        layer means the layer after it is done: its recompute is freed."""
        layer, host = packed
        if layer != self.recomputing:
            self._release(self.recompute_bytes)
            self.recomputing = layer
            recompute = self.spec.layers[layer].bwd_extra(self.u) if self.spec is not None else 0.0
            self.recompute_bytes = recompute + self.output_bytes[layer]
            self._charge(self.recompute_bytes, f"recompute of layer {layer}")
        t = self._to_device(host)
        self.recompute_bytes += nbytes([t])
        self._charge(nbytes([t]), f"input of layer {layer}")
        return t

    def _update(self) -> None:
        """Gradients out, the optimizer step on the host, weights in."""
        for p, m in zip(self.params, self.master):
            started = time.perf_counter()
            m.grad.copy_(p.grad, non_blocking=self.pin)
            self._paced("d2h", m.grad, started)
        self._synchronize()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                started = time.perf_counter()
                p.copy_(m, non_blocking=self.pin)
                self._paced("h2d", p, started)
        self.layers.zero_grad(set_to_none=True)
        self._synchronize()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = t.to(self.torch_device, non_blocking=self.pin, copy=True)
        self._paced("h2d", out, started)
        return out

    def _paced(self, route: str, t: torch.Tensor, started: float) -> None:
        """Count a copy's bytes; on the emulated device, sleep until the link would have carried them."""
        n = nbytes([t])
        self.moved[route] += n
        if self.pacer is not None:
            self.pacer.wait((route,), n, self.rates[route], started)

    def _charge(self, n: float, what: str) -> None:
        self.ledger.charge(n, what)
        self.transient += n

    def _release(self, n: float) -> None:
        self.ledger.release(n)
        self.transient -= n

    def _synchronize(self) -> None:
        if not self.emulated:
            torch.cuda.synchronize(self.torch_device)


def fastest_microbatch(run: Callable[[int], float], sizes, log=print) -> int | None:
    """The microbatch size a user would pick: from the largest of ``sizes`` down,
    ``run(u)`` times one step; the fastest that does not run out of memory,
    stopping at the first that is slower than the best so far. None: none fits."""
    best, best_s = None, math.inf
    for u in sorted(set(sizes), reverse=True):
        try:
            seconds = run(u)
        except OOM as e:
            log(f"    microbatch {u}: out of memory ({str(e).splitlines()[0][:110]})")
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log(f"    microbatch {u}: {seconds:.2f} s/step")
        if seconds >= best_s:
            break
        best, best_s = u, seconds
    return best


def timed(step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def gpt2_config(hidden: int, blocks: int, seq_len: int, vocab: int) -> dict:
    return dict(hidden=hidden, n_layer=blocks, heads=max(1, hidden // 64), seq_len=seq_len, max_position=seq_len,
                vocab=vocab)


# ---- emulated device -------------------------------------------------------------
def run_emulated(args) -> None:
    torch.set_num_threads(1)
    flops = cpu_flops()
    rate = flops / FLOP_PER_BYTE_1080TI
    device = EmulatedDevice(memory=args.memory, h2d=rate, d2h=rate)
    print(f"CPU {flops / 1e9:.1f} GFLOP/s (1 thread) -> emulated link {rate / 1e6:.1f} MB/s per direction; "
          f"device {device.capacity / 1e6:.1f} MB")
    cfg = gpt2_config(args.hidden, args.blocks, args.seq_len, args.vocab)
    if compare(cfg, args, device):
        return
    smaller = blocks_that_fit(cfg, device)
    if smaller is None:
        print("\nno smaller model of this width leaves the baseline room on this device")
        return
    print(f"\nagain with {smaller} blocks, a model whose weights and gradients take under half the device:")
    compare({**cfg, "n_layer": smaller}, args, device)


def blocks_that_fit(cfg: dict, device: EmulatedDevice) -> int | None:
    """The most transformer blocks for which weights and gradients take at most
    half of the device (the rest for the recipe's activations)."""
    one, two = (sum(p.numel() for p in build_model("gpt2-tiny", 0, dropout=0.0, **{**cfg, "n_layer": n}).parameters())
                for n in (1, 2))
    per_block, rest = two - one, 2 * one - two
    blocks = int((device.capacity / 2 / 8 - rest) // per_block)
    return min(blocks, cfg["n_layer"] - 1) if blocks >= 1 else None


def compare(cfg: dict, args, device: EmulatedDevice) -> bool:
    """Harmony and the recipe on ``device``, interleaved; False if the recipe fits at no microbatch size."""
    model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", args.minibatch, **cfg)
    spec = profile(list(model), (x,), y, lm_loss, flat_adamw, name="gpt2-bench")
    params = sum(p.numel() for p in model.parameters())
    activations = sum(c.bwd_extra(args.minibatch) for c in spec.layers)
    footprint = params * 4 * 4 + activations
    print(f"\nGPT-2 {cfg['n_layer']} x {cfg['hidden']}, seq {cfg['seq_len']}, minibatch {args.minibatch}: "
          f"{params:,} params, weights {params * 4 / 1e6:.1f} MB = {params * 4 / device.capacity:.2f}x the device; "
          f"training footprint (weights, gradients, 2 AdamW states, activations) {footprint / 1e6:.1f} MB = "
          f"{footprint / device.capacity:.1f}x the device")
    print(f"  the recipe keeps weights + gradients on the device: {params * 8 / 1e6:.1f} MB = "
          f"{params * 8 / device.capacity:.2f}x the device, plus activations of one layer's recompute")

    hw = replace(device.hardware(), task_overhead_s=measure_task_overhead(device))
    df = search(spec, hw, args.minibatch, policies=("harmony-pp",), n_gpus=1, workers=1)
    plan, simulated = df.iloc[0]["plan"], df.iloc[0]["iteration_s"]
    print(f"  harmony: {plan.describe()} (simulated {simulated:.3f} s/step)")

    def trial(u: int) -> float:
        baseline = TorchOffload(copy.deepcopy(model), flat_adamw, lm_loss, device, u, spec)
        return timed(lambda: baseline.step(x, y))

    try:  # weights and gradients alone may not fit, whatever the microbatch size
        TorchOffload(copy.deepcopy(model), flat_adamw, lm_loss, device, args.minibatch, spec)
    except OutOfMemoryError:
        u = None
    else:
        print("  the recipe's microbatch size, tuned (one step each):")
        u = fastest_microbatch(trial, default_sizes(args.minibatch) + [plan.fwd_microbatch])
    systems = {"harmony-pp": Engine(copy.deepcopy(model), flat_adamw, lm_loss, device=device,
                                    minibatch_size=args.minibatch, plan=plan)}
    if u is None:
        print(f"  the recipe does not fit the device at any microbatch size (weights and gradients take "
              f"{params * 8 / 1e6:.1f} MB of {device.capacity / 1e6:.1f} MB); harmony runs alone:")
    else:
        systems["torch offload"] = TorchOffload(copy.deepcopy(model), flat_adamw, lm_loss, device, u, spec)
        systems["torch offload, torch AdamW"] = TorchOffload(copy.deepcopy(model), torch_adamw, lm_loss, device,
                                                             u, spec)
    times = {name: [] for name in systems}
    for step in range(args.steps):  # interleaved: drift in the machine's load hits every system alike
        for name, system in systems.items():
            times[name].append(timed(lambda: system.step(x, y)))
        if step == 0 and u is not None:
            same_training(systems["harmony-pp"], systems["torch offload"])
    report(systems, times, args, device, plan, u, simulated)
    return u is not None


def same_training(engine: Engine, baseline: TorchOffload) -> None:
    """After one step from the same weights on the same minibatch, how far apart the weights are."""
    diff = max((a - b).abs().max().item() for a, b in zip(engine.model.parameters(), baseline.master))
    scale = max(p.abs().max().item() for p in baseline.master)
    print(f"  after the first step: max |harmony - recipe| over the weights {diff:.2e} (largest weight {scale:.2f})")


def report(systems: dict, times: dict, args, device: EmulatedDevice, plan, u: int | None, simulated: float) -> None:
    rows = {}
    for name, system in systems.items():
        if isinstance(system, Engine):
            summary = system.trace.summary
            moved, peak = summary["swap_bytes"], summary["peak_memory"]["gpu0"]
            micro = f"{plan.fwd_microbatch}/{plan.bwd_microbatch}"
        else:
            moved, peak, micro = sum(system.moved.values()), system.peak_memory, f"{u}"
        rows[name] = (args.minibatch / statistics.median(times[name][1:]), moved, peak, micro)
    names = list(rows)
    print(f"\nmeasured, median of {args.steps - 1} steps (the first is left out); device {device.capacity / 1e6:.1f} MB")
    print(f"  {'':28s}" + "".join(f"{n:>28s}" for n in names))
    print(f"  {'microbatch (fwd/bwd)':28s}" + "".join(f"{rows[n][3]:>28s}" for n in names))
    print(f"  {'samples/s':28s}" + "".join(f"{rows[n][0]:28.2f}" for n in names))
    print(f"  {'host-link MB per step':28s}" + "".join(f"{rows[n][1] / 1e6:28.1f}" for n in names))
    print(f"  {'peak device MB':28s}" + "".join(
        f"{f'{rows[n][2] / 1e6:.1f} ({rows[n][2] / device.capacity:.0%})':>28s}" for n in names))
    print(f"  harmony simulated {simulated:.3f} s/step = {args.minibatch / simulated:.2f} samples/s")
    h = rows["harmony-pp"]
    for name in names[1:]:
        b = rows[name]
        print(f"  harmony / {name}: samples/s {h[0] / b[0]:.2f}x, host-link bytes {h[1] / b[1]:.2f}x")


# ---- a real GPU ------------------------------------------------------------------
class Checkpointed(nn.Module):
    """A layer whose forward is activation-checkpointed (what torch's checkpoint_wrapper does)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False)


class FSDP2Offload:
    """FSDP2 on one GPU, every layer and the root sharded with
    ``CPUOffloadPolicy`` (parameters, gradients and torch.optim.AdamW on the
    host; each layer's weights gathered to the GPU as it runs), checkpointed
    layers, gradient accumulation over microbatches (each microbatch's gradient
    is reduced into the host's)."""

    def __init__(self, model: nn.Sequential, loss_fn: Callable, microbatch_size: int, dtype: torch.dtype | None):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        self.model = nn.Sequential(*(Checkpointed(layer) for layer in model))
        for block in self.model:
            fully_shard(block, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        # the logits in float32 for the loss, as under torch.autocast
        fully_shard(self.model, offload_policy=CPUOffloadPolicy(), mp_policy=replace(mp, output_dtype=torch.float32))
        self.optimizer = torch_adamw(self.model.parameters())
        self.loss_fn, self.microbatch_size = loss_fn, microbatch_size

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        total = y.shape[0]
        for a, b in split_samples(total, self.microbatch_size):
            out = self.model(x[a:b].cuda(non_blocking=True))
            (self.loss_fn(out, y[a:b].cuda(non_blocking=True)) * ((b - a) / total)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()


class DeepSpeedOffload:
    """DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer (DeepSpeed's CPU
    Adam, AdamW mode) and its float32 master weights on the host, checkpointed
    layers, gradient accumulation by DeepSpeed."""

    def __init__(self, model: nn.Sequential, loss_fn: Callable, microbatch_size: int, minibatch: int,
                 dtype: torch.dtype | None):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": microbatch_size,
            "gradient_accumulation_steps": minibatch // microbatch_size,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "bf16": {"enabled": dtype == torch.bfloat16},
        }
        chain = nn.Sequential(*(Checkpointed(layer) for layer in model))
        self.engine, *_ = deepspeed.initialize(model=chain, model_parameters=chain.parameters(), config=config)
        self.loss_fn, self.microbatch_size = loss_fn, microbatch_size

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for a, b in split_samples(y.shape[0], self.microbatch_size):
            loss = self.loss_fn(self.engine(x[a:b].cuda(non_blocking=True)), y[a:b].cuda(non_blocking=True))
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed steps the optimizer at the last microbatch of the minibatch
        torch.cuda.synchronize()


def measured_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of a large matmul in ``dtype`` on the GPU: the denominator of model-FLOPs utilization."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t0)


def init_single_process_group(device: torch.device) -> None:
    """A torch.distributed group of one process (FSDP2 and DeepSpeed need one)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=device)


def run_cuda(args) -> None:
    if not torch.cuda.is_available():
        print("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False); nothing measured")
        return
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.precision]
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = min(parse_bytes(args.memory, "--memory"), total)
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    cfg = gpt2_config(args.hidden, args.blocks, args.seq_len, args.vocab)
    model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", args.minibatch, **cfg)
    params = sum(p.numel() for p in model.parameters())
    peak = measured_peak_flops(dev, dtype or torch.float32)
    print(f"{torch.cuda.get_device_name(dev)}: usable memory capped at {cap / 1e9:.1f} of {total / 1e9:.1f} GB; "
          f"matmul peak {peak / 1e12:.1f} TFLOP/s in {dtype or torch.float32}")
    print(f"GPT-2 {cfg['n_layer']} x {cfg['hidden']}, seq {cfg['seq_len']}, vocab {cfg['vocab']}: {params / 1e9:.2f} B "
          f"params; plain training needs {params * 16 / 1e9:.1f} GB (weights, gradients, 2 AdamW states) plus "
          f"activations; minibatch {args.minibatch}, {args.precision}")

    results = {}

    def measure(name: str, make: Callable[[int], object], sizes: list[int]) -> None:
        """Tune the microbatch size (each try on a fresh instance), then time
        ``args.steps`` steps of a fresh instance at the chosen size."""
        system = None
        try:
            u = sizes[0]
            if len(sizes) > 1:
                print(f"{name}: microbatch size, tuned (one step each):")
                u = fastest_microbatch(lambda u: timed(lambda: make(u).step(x, y)), sizes)
                if u is None:
                    print(f"  {name}: out of memory at every microbatch size")
                    return
            system = make(u)
            torch.cuda.reset_peak_memory_stats(dev)
            times = [timed(lambda: system.step(x, y)) for _ in range(args.steps)]
            micro = f"{system.plan.fwd_microbatch}/{system.plan.bwd_microbatch}" if isinstance(system, Engine) else str(u)
            results[name] = (statistics.median(times[1:]), torch.cuda.max_memory_allocated(dev), micro)
        except Exception as e:  # one system failing is a result; the others still run
            print(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            system = None
            gc.collect()
            torch.cuda.empty_cache()

    sizes = default_sizes(args.minibatch)
    measure("harmony-pp", lambda u: harmony_on_cuda(model, x, y, args, dev, cap), [args.minibatch])
    measure("torch offload", lambda u: TorchOffload(copy.deepcopy(model), flat_adamw, lm_loss, "cuda:0", u,
                                                     autocast=dtype), sizes)
    init_single_process_group(dev)
    try:
        measure("FSDP2 + CPUOffloadPolicy", lambda u: FSDP2Offload(copy.deepcopy(model), lm_loss, u, dtype), sizes)
        if importlib.util.find_spec("deepspeed") is None:
            print("DeepSpeed ZeRO-Offload: deepspeed not installed")
        else:
            measure("DeepSpeed ZeRO-Offload",
                    lambda u: DeepSpeedOffload(copy.deepcopy(model), lm_loss, u, args.minibatch, dtype),
                    [u for u in sizes if args.minibatch % u == 0])
    finally:
        torch.distributed.destroy_process_group()

    flop_per_step = 6 * params * args.minibatch * cfg["seq_len"]
    print(f"\nmeasured, median of {args.steps - 1} steps each (the first is left out), one system at a time")
    print(f"  {'system':28s}{'microbatch':>11s}{'samples/s':>11s}{'harmony is':>12s}{'MFU':>8s}{'peak GB':>9s}")
    base = results.get("harmony-pp")
    for name, (seconds, peak_bytes, micro) in results.items():
        ratio = f"{seconds / base[0]:.2f}x" if base else "-"
        print(f"  {name:28s}{micro:>11s}{args.minibatch / seconds:11.2f}{ratio:>12s}"
              f"{flop_per_step / seconds / peak:8.1%}{peak_bytes / 1e9:9.2f}")
    print("  harmony is: harmony's samples/s over the system's; MFU: 6 x params x tokens per step / step time / "
          "matmul peak")


def harmony_on_cuda(model: nn.Sequential, x, y, args, dev: torch.device, cap: int) -> Engine:
    """The engine with the plan ``plan="auto"`` would pick, searched for the
    capped memory (less the engine's planning headroom) instead of the whole GPU."""
    engine = Engine(copy.deepcopy(model), flat_adamw, lm_loss, device="cuda:0", minibatch_size=args.minibatch,
                    precision=args.precision)
    spec = engine.in_precision(profile(engine.layers, (x,), y, lm_loss, flat_adamw, device=dev, name="gpt2-bench",
                                       dtype=engine.compute_dtype))
    engine.task_overhead_s = measure_task_overhead("cuda:0")
    hw = replace(engine.hardware(), gpu_memory=int(cap * PLANNING_HEADROOM))
    df = search(spec, hw, args.minibatch, policies=("harmony-pp",), n_gpus=1, workers=1)
    engine.set_plan(df.iloc[0]["plan"])
    print(f"harmony-pp: {engine.plan.describe()} (simulated {df.iloc[0]['iteration_s']:.3f} s/step)")
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("emulated", "cuda"), default="emulated")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--blocks", type=int)
    ap.add_argument("--minibatch", type=int)
    ap.add_argument("--memory", help="device capacity (emulated) or usable GPU memory (cuda)")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="cuda only")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out of the timings)")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    run_emulated(args) if args.device == "emulated" else run_cuda(args)


if __name__ == "__main__":
    main()
