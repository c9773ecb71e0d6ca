"""One CPU AdamW step over a pack of transformer layers: torch's implementations
vs harmony's FlatAdamW, side by side in one run.

The pack is float32 GPT-2 blocks (the 12 tensors of each: attention qkv and
projection, MLP, two LayerNorms) of ``--size`` parameter bytes in all (default
1 GiB = 256M elements); its gradients and the optimizer's two moments take as
much again each. Every variant gets the same parameters and gradients; each
round makes every variant's optimizer afresh (its first step allocates the
state and is not timed), times ``--steps`` steps, and frees it, so only one
optimizer state is alive at a time (about 4x ``--size`` in all, plus what a
variant allocates while stepping). Printed per variant, medians over rounds:

* seconds per step;
* bytes streamed per second, counting what AdamW must touch: it reads the
  parameter, its gradient, exp_avg and exp_avg_sq and writes the parameter,
  exp_avg and exp_avg_sq, 7 x 4 bytes per element;
* that rate as a fraction of this machine's copy bandwidth, measured in the
  same rounds (``copy_`` of a ``--size`` tensor, bytes read + written per
  second). An update in place can exceed 1.0: a copy's destination is
  written without being read, which the cache first fetches anyway (write
  allocate), so ``copy_`` moves about 3 bytes for the 2 it counts. Hence also
  the fraction of the in-place bandwidth (``add_`` of a scalar to a
  ``--size`` tensor, bytes read + written per second), the tighter bound;
* speedup over torch's default (on CPU: the for-loop implementation).

    python bench/optimizer.py [--size 1GiB] [--rounds 5] [--steps 2]
"""

import argparse
import math
import statistics
import time

import torch

import harmony
from harmony.engine.optim import FlatAdamW, fused_kernel_available

BYTES_PER_ELEMENT = 7 * 4  # AdamW in float32: 4 tensors read, 3 written


def gpt2_blocks(size_bytes: int, blocks: int = 8) -> tuple[int, list[torch.Tensor]]:
    """The hidden size h that makes ``blocks`` GPT-2 blocks (12 h^2 + 13 h float32
    parameters each) about ``size_bytes``, and their tensors."""
    h = max(64, round(math.sqrt(size_bytes / 4 / blocks / 12) / 64) * 64)
    shapes = [
        (3 * h, h),
        (3 * h,),
        (h, h),
        (h,),
        (4 * h, h),
        (4 * h,),
        (h, 4 * h),
        (h,),
        (h,),
        (h,),
        (h,),
        (h,),
    ]
    return h, [torch.randn(s) for _ in range(blocks) for s in shapes]


def variants() -> dict:
    """name -> optimizer factory; torch's fused CPU kernel only where this torch has it."""
    out = {
        "torch AdamW (default: for-loop)": lambda ps: torch.optim.AdamW(ps, foreach=False),
        "torch AdamW foreach=True": lambda ps: torch.optim.AdamW(ps, foreach=True),
    }
    if fused_kernel_available():
        out["torch AdamW fused=True"] = lambda ps: torch.optim.AdamW(ps, fused=True)
        out["harmony FlatAdamW (fused kernel)"] = lambda ps: FlatAdamW(ps)
    out["harmony FlatAdamW fused=False (exact)"] = lambda ps: FlatAdamW(ps, fused=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1GiB", help="parameter bytes (float32), e.g. 1GiB, 256MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    args = ap.parse_args()
    hidden, weights = gpt2_blocks(harmony.parse_bytes(args.size, "--size"))
    numel = sum(w.numel() for w in weights)
    params = [torch.nn.Parameter(w) for w in weights]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(
        f"{len(params)} float32 tensors (8 GPT-2 blocks, hidden {hidden}), {numel / 1e6:.1f}M "
        f"elements = {numel * 4 / 2**30:.2f} GiB of parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.rounds} rounds x {args.steps} steps"
    )
    if not fused_kernel_available():
        print("torch's fused CPU AdamW kernel: not in this torch, skipped")

    src, dst = torch.randn(numel), torch.empty(numel)
    times: dict[str, list[float]] = {"copy_": [], "add_": []}
    factories = variants()
    for _ in range(
        args.rounds
    ):  # interleaved: drift in the machine's load hits every variant alike
        for name, stream in (("copy_", lambda: dst.copy_(src)), ("add_", lambda: dst.add_(1.0))):
            stream()
            t0 = time.perf_counter()
            stream()
            times[name].append(time.perf_counter() - t0)
        for name, make in factories.items():
            opt = make(params)
            opt.step()  # allocates the state
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times.setdefault(name, []).append((time.perf_counter() - t0) / args.steps)
            del opt

    copy_rate, in_place_rate = (
        2 * numel * 4 / statistics.median(times[k]) for k in ("copy_", "add_")
    )
    print(
        f"bandwidth (bytes read + written): copy_ {copy_rate / 1e9:.1f} GB/s, in place (add_) "
        f"{in_place_rate / 1e9:.1f} GB/s"
    )
    base = statistics.median(times["torch AdamW (default: for-loop)"])
    print(
        f"{'':40s} {'s/step':>8s} {'GB/s (7x4 B/elem)':>18s} {'x copy_':>8s} {'x in place':>10s} "
        f"{'speedup':>8s}"
    )
    for name in factories:
        t = statistics.median(times[name])
        rate = numel * BYTES_PER_ELEMENT / t
        print(
            f"{name:40s} {t:8.3f} {rate / 1e9:18.1f} {rate / copy_rate:8.2f} "
            f"{rate / in_place_rate:10.2f} {base / t:7.2f}x"
        )


if __name__ == "__main__":
    main()
