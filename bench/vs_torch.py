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
page-locked memory, FSDP2 on one GPU with ``CPUOffloadPolicy`` (bf16 gathers of float32
master weights under ``torch.autocast``, see ``harmony.workbench.fsdp_offload``; and
checkpointed layers), and DeepSpeed ZeRO-Offload (stage 2, optimizer on the
CPU) where ``deepspeed`` is installed. The systems run one after another (they
cannot share the capped memory). Printed per system: samples/s, the ratio to
harmony and model-FLOPs utilization (6 x parameters x tokens per step / step
time / the GPU's measured matmul FLOP/s). A system that fails prints why.

    python bench/vs_torch.py [--steps 6] [--hidden 256] [--blocks 6] [--minibatch 32] \
        [--memory 56MB]
    python bench/vs_torch.py --device cuda [--precision bf16] [--hidden 2048] [--blocks 24] \
        [--minibatch 8] [--memory 16GB]
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import statistics
import time
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

import harmony
from harmony import Engine, FlatAdamW
from harmony.costs.hardware import parse_bytes
from harmony.engine.profiler import default_sizes, profile
from harmony.plan import split_samples
from harmony.planner.search import search
from harmony.workbench.baselines import TorchOffload, fastest_microbatch, timed
from harmony.workbench.experiments import gpt2_config, torch_offload_comparison
from harmony.workbench.fsdp_offload import Checkpointed, FSDP2Offload, single_process_group
from harmony.workbench.training import build_model, lm_loss

DEFAULTS = {
    "emulated": dict(
        steps=6, hidden=256, blocks=6, minibatch=32, memory="56MB", seq_len=64, vocab=512
    ),
    "cuda": dict(
        steps=3, hidden=2048, blocks=24, minibatch=8, memory="16GB", seq_len=1024, vocab=50257
    ),
}


def flat_adamw(params):
    return FlatAdamW(params, lr=1e-4)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


# ---- emulated device -------------------------------------------------------------
def run_emulated(args) -> None:
    table, details = report(
        torch_offload_comparison(
            args.hidden,
            args.blocks,
            args.minibatch,
            args.memory,
            args.steps - 1,
            args.seq_len,
            args.vocab,
        )
    )
    if (table.status == "ran").all():
        return
    cfg = gpt2_config(args.hidden, args.blocks, args.seq_len, args.vocab)
    smaller = blocks_that_fit(cfg, parse_bytes(args.memory, "--memory"))
    if smaller is None:
        print("\nno smaller model of this width leaves the recipe room on this device")
        return
    print(
        f"\nagain with {smaller} blocks, a model whose weights and gradients take under half the "
        "device:"
    )
    report(
        torch_offload_comparison(
            args.hidden,
            smaller,
            args.minibatch,
            args.memory,
            args.steps - 1,
            args.seq_len,
            args.vocab,
            link=details["link_mb_s"] * 1e6,
        )
    )


def blocks_that_fit(cfg: dict, capacity: int) -> int | None:
    """The most transformer blocks for which weights and gradients take at most
    half of the device (the rest for the recipe's activations)."""
    one, two = (
        sum(
            p.numel()
            for p in build_model("gpt2-tiny", 0, dropout=0.0, **{**cfg, "n_layer": n}).parameters()
        )
        for n in (1, 2)
    )
    per_block, rest = two - one, 2 * one - two
    blocks = int((capacity / 2 / 8 - rest) // per_block)
    return min(blocks, cfg["n_layer"] - 1) if blocks >= 1 else None


def report(result):
    table, d = result
    print(
        f"{d['model']}: {d['params']:,} params, weights {d['weights_mb']:.1f} MB; training "
        f"footprint (weights, gradients, 2 AdamW states, activations) {d['footprint_mb']:.1f} MB "
        f"= {d['footprint_mb'] / d['capacity_mb']:.1f}x the {d['capacity_mb']:.1f} MB device; "
        f"link {d['link_mb_s']:.1f} MB/s per direction"
    )
    print(f"  the recipe keeps weights + gradients on the device: {d['weights_mb'] * 2:.1f} MB")
    print(f"  harmony: {d['harmony_plan']} (simulated {d['harmony_simulated_s']:.3f} s/step)")
    print("  the recipe's microbatch size, tuned (one step each):")
    for line in d["tuning"] or ["weights and gradients alone do not fit"]:
        print(f"    {line}")
    if "first_step_max_weight_diff" in d:
        print(
            "  after the first step: max |harmony - recipe| over the weights "
            f"{d['first_step_max_weight_diff']:.2e}"
        )
    print("\n" + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for r in table.iloc[1:].itertuples():
        if r.status == "ran":
            print(
                f"harmony / {r.system}: samples/s {r.harmony_speedup:.2f}x, host-link bytes "
                f"{r.harmony_bytes_ratio:.2f}x"
            )
        else:
            print(
                f"{r.system}: {r.status}; harmony runs at {table.iloc[0].samples_per_s:.2f} "
                "samples/s"
            )
    return table, d


# ---- a real GPU ------------------------------------------------------------------
class DeepSpeedOffload:
    """DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer (DeepSpeed's CPU
    Adam, AdamW mode) and its float32 master weights on the host, checkpointed
    layers, gradient accumulation by DeepSpeed."""

    def __init__(
        self,
        model: nn.Sequential,
        loss_fn: Callable,
        microbatch_size: int,
        minibatch: int,
        dtype: torch.dtype | None,
    ):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": microbatch_size,
            "gradient_accumulation_steps": minibatch // microbatch_size,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
            },
            "bf16": {"enabled": dtype == torch.bfloat16},
        }
        chain = nn.Sequential(*(Checkpointed(layer) for layer in model))
        if dtype is not None:
            # DeepSpeed's bf16 mode casts the parameters, not the buffers, and turns
            # torch.autocast off inside its forward: GPT-2's float32 causal-mask buffer,
            # added to the bf16 scores, made them float32 and the next matmul failed
            # ("expected scalar type Float but found BFloat16", on an H100). Its values
            # (0 and -inf) are exact in any float dtype.
            for b in chain.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(dtype)
        self.engine, *_ = deepspeed.initialize(
            model=chain, model_parameters=chain.parameters(), config=config
        )
        self.loss_fn, self.microbatch_size = loss_fn, microbatch_size

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for a, b in split_samples(y.shape[0], self.microbatch_size):
            loss = self.loss_fn(
                self.engine(x[a:b].cuda(non_blocking=True)), y[a:b].cuda(non_blocking=True)
            )
            self.engine.backward(loss)
            # DeepSpeed steps the optimizer at the last microbatch of the minibatch
            self.engine.step()
        torch.cuda.synchronize()


def measured_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of a large matmul in ``dtype`` on the GPU: the denominator of model-FLOPs
    utilization."""
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


def run_cuda(args) -> None:
    if not torch.cuda.is_available():
        print(
            "--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False); "
            "nothing measured"
        )
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
    print(
        f"{torch.cuda.get_device_name(dev)}: usable memory capped at {cap / 1e9:.1f} of "
        f"{total / 1e9:.1f} GB; matmul peak {peak / 1e12:.1f} TFLOP/s in {dtype or torch.float32}"
    )
    print(
        f"GPT-2 {cfg['n_layer']} x {cfg['hidden']}, seq {cfg['seq_len']}, vocab {cfg['vocab']}: "
        f"{params / 1e9:.2f} B params; plain training needs {params * 16 / 1e9:.1f} GB (weights, "
        f"gradients, 2 AdamW states) plus activations; minibatch {args.minibatch}, "
        f"{args.precision}"
    )

    results = {}

    def measure(name: str, make: Callable[[int], object], sizes: list[int]) -> None:
        """Tune the microbatch size (each try on a fresh instance), then time
        ``args.steps`` steps of a fresh instance at the chosen size."""
        system = None
        try:
            u = sizes[0]
            if len(sizes) > 1:
                print(f"{name}: microbatch size, tuned (one step each):")
                u = fastest_microbatch(
                    lambda u: timed(lambda: make(u).step(x, y)),
                    sizes,
                    log=lambda line: print(f"    {line}"),
                )
                if u is None:
                    print(f"  {name}: out of memory at every microbatch size")
                    return
            system = make(u)
            torch.cuda.reset_peak_memory_stats(dev)
            times = [timed(lambda: system.step(x, y)) for _ in range(args.steps)]
            micro = (
                f"{system.plan.fwd_microbatch}/{system.plan.bwd_microbatch}"
                if isinstance(system, Engine)
                else str(u)
            )
            results[name] = (
                statistics.median(times[1:]),
                torch.cuda.max_memory_allocated(dev),
                micro,
            )
        except Exception as e:  # one system failing is a result; the others still run
            print(
                f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
        finally:
            system = None
            gc.collect()
            torch.cuda.empty_cache()

    sizes = default_sizes(args.minibatch)
    measure("harmony-pp", lambda u: harmony_on_cuda(model, x, y, args, dev, cap), [args.minibatch])
    measure(
        "torch offload",
        lambda u: TorchOffload(
            copy.deepcopy(model), flat_adamw, lm_loss, "cuda:0", u, autocast=dtype
        ),
        sizes,
    )
    with single_process_group(dev):
        measure(
            "FSDP2 + CPUOffloadPolicy",
            lambda u: FSDP2Offload(copy.deepcopy(model), lm_loss, u, dtype),
            sizes,
        )
        if importlib.util.find_spec("deepspeed") is None:
            print("DeepSpeed ZeRO-Offload: deepspeed not installed")
        else:
            measure(
                "DeepSpeed ZeRO-Offload",
                lambda u: DeepSpeedOffload(
                    copy.deepcopy(model), lm_loss, u, args.minibatch, dtype
                ),
                [u for u in sizes if args.minibatch % u == 0],
            )

    flop_per_step = 6 * params * args.minibatch * cfg["seq_len"]
    print(
        f"\nmeasured, median of {args.steps - 1} steps each (the first is left out), one system "
        "at a time"
    )
    print(
        f"  {'system':28s}{'microbatch':>11s}{'samples/s':>11s}{'harmony is':>12s}"
        f"{'MFU':>8s}{'peak GB':>9s}"
    )
    base = results.get("harmony-pp")
    for name, (seconds, peak_bytes, micro) in results.items():
        ratio = f"{seconds / base[0]:.2f}x" if base else "-"
        print(
            f"  {name:28s}{micro:>11s}{args.minibatch / seconds:11.2f}{ratio:>12s}"
            f"{flop_per_step / seconds / peak:8.1%}{peak_bytes / 1e9:9.2f}"
        )
    print(
        "  harmony is: harmony's samples/s over the system's; MFU: 6 x params x tokens per step "
        "/ step time / matmul peak"
    )


def harmony_on_cuda(model: nn.Sequential, x, y, args, dev: torch.device, cap: int) -> Engine:
    """The engine with the plan ``plan="auto"`` would pick, searched for the
    capped memory (less the engine's planning headroom) instead of the whole GPU."""
    engine = Engine(
        copy.deepcopy(model),
        flat_adamw,
        lm_loss,
        device="cuda:0",
        minibatch_size=args.minibatch,
        precision=args.precision,
    )
    spec = profile(
        engine.layers,
        (x,),
        y,
        lm_loss,
        flat_adamw,
        device=dev,
        name="gpt2-bench",
        dtype=engine.compute_dtype,
    )
    # 90% of the cap: the CUDA allocator's own slack, as Engine leaves it on a whole GPU
    hw = replace(engine.hardware(), gpu_memory=int(cap * 0.9))
    df = search(spec, hw, args.minibatch, policies=("harmony-pp",), n_gpus=1, workers=1)
    engine.set_plan(df.iloc[0]["plan"])
    print(
        f"harmony-pp: {engine.plan.describe()} (simulated {df.iloc[0]['iteration_s']:.3f} s/step)"
    )
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
