"""What reused buffers and flat per-pack copies save, measured side by side.

1. Moving one pack's weights (``--pack`` GPT-2 blocks) into device memory, three
   ways, on this CPU: a fresh clone per tensor (what the emulated GPU did
   before pools), a copy per tensor into buffers reused from the last time,
   and one copy of the pack's flat slice into one reused buffer (what the
   engine does now). Printed: time per pack, GB/s, copies per pack, ratios.
2. The engine on an emulated GPU whose link is too fast to matter (so copies
   are not hidden behind paced waits) with the engine's pools and flat host
   weights, and with both switched off (host weights left per tensor, pooled
   buffers never given back, so every copy takes fresh memory, as before).
   Steps interleaved; printed: median step time and its ratio, and the
   buffers each step had to allocate.

    python bench/buffers.py [--hidden 256] [--blocks 6] [--pack 2] [--minibatch 16] [--steps 12]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

import harmony
from harmony import EmulatedDevice, Engine, FlatAdamW, Plan
from harmony.engine import buffers, host_memory
from harmony.engine.profiler import median_time
from harmony.workbench.training import build_model, lm_loss, torch_threads


def pack_copies(layers, pack: int, repeats: int) -> None:
    tensors = [p.detach() for layer in layers[1 : 1 + pack] for p in layer.parameters()]
    flat = torch.cat([t.reshape(-1) for t in tensors])  # the host layout: the pack is one slice
    nbytes = flat.numel() * flat.element_size()
    reused = [torch.empty_like(t) for t in tensors]
    reused_flat = torch.empty_like(flat)

    def copy_each():
        for dst, src in zip(reused, tensors):
            dst.copy_(src)

    ways = {
        "fresh clone per tensor": (lambda: [t.clone() for t in tensors], len(tensors)),
        "reused buffer per tensor": (copy_each, len(tensors)),
        "one flat copy, reused": (lambda: reused_flat.copy_(flat), 1),
    }
    print(
        f"one pack of {pack} GPT-2 blocks: {len(tensors)} tensors, {nbytes / 1e6:.1f} MB "
        f"(median of {repeats})"
    )
    seconds = {}
    for name, (fn, copies) in ways.items():
        seconds[name] = median_time(fn, repeats)
        print(
            f"  {name:26s} {seconds[name] * 1e3:7.3f} ms  {nbytes / seconds[name] / 1e9:6.2f} "
            f"GB/s  {copies:3d} copies"
        )
    first = seconds["fresh clone per tensor"]
    print(
        "  speedup over a fresh clone per tensor: "
        + ", ".join(
            f"{name} {first / s:.2f}x"
            for name, s in seconds.items()
            if s is not seconds["fresh clone per tensor"]
        )
    )


def per_tensor_engine(make):
    """An engine as it was before: host weights left per tensor (too little host
    memory to flatten them, as far as it knows)."""
    with (
        mock.patch.object(host_memory, "available_host_bytes", lambda: 0),
        mock.patch("warnings.warn"),
    ):
        return make()


def fresh_buffers():
    """Pools that never get a buffer back: every copy takes fresh memory."""
    return mock.patch.object(buffers.BufferPool, "give", lambda self, t: None)


def engine_steps(cfg: dict, minibatch: int, steps: int) -> None:
    (x,), y = harmony.zoo.example_input("gpt2-tiny", minibatch, **cfg)
    n = len(build_model("gpt2-tiny", 0, dropout=0.0, **cfg))
    packs = tuple(
        (i, min(i + 2, n)) for i in range(0, n, 2)
    )  # two layers each; the last backward pack fused
    plan = Plan("harmony-pp", 1, minibatch, minibatch // 4, minibatch // 4, packs[:-1], packs)
    device = EmulatedDevice(memory="10GB", h2d="1000GB/s", d2h="1000GB/s")

    def make():
        return Engine(
            build_model("gpt2-tiny", 0, dropout=0.0, **cfg),
            lambda ps: FlatAdamW(ps, lr=1e-4),
            lm_loss,
            device=device,
            minibatch_size=minibatch,
            plan=plan,
        )

    reuse, fresh = make(), per_tensor_engine(make)
    print(
        f"\nthe engine on an emulated GPU with a 1000 GB/s link: {plan.describe()}; steps "
        f"interleaved, median of {steps - 1}"
    )
    times = {"reused buffers, flat copies": [], "fresh buffers, per-tensor copies": []}
    allocated = {name: [] for name in times}
    for _ in range(steps):
        for name, engine in (
            ("reused buffers, flat copies", reuse),
            ("fresh buffers, per-tensor copies", fresh),
        ):
            with fresh_buffers() if engine is fresh else contextlib.nullcontext():
                t0 = time.perf_counter()
                engine.step(x, y)
                times[name].append(time.perf_counter() - t0)
            allocated[name].append(
                (engine.trace.summary.new_buffers, engine.trace.summary.new_buffer_bytes)
            )
    for name in times:
        count, nbytes = allocated[name][-1]
        print(
            f"  {name:34s} {statistics.median(times[name][1:]) * 1e3:8.1f} ms/step; the last step "
            f"allocated {count} buffers, {nbytes / 1e6:.1f} MB"
        )
    a, b = (statistics.median(t[1:]) for t in times.values())
    print(f"  fresh / reused step time: {b / a:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--pack", type=int, default=2)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    cfg = dict(
        hidden=args.hidden, n_layer=args.blocks, heads=4, seq_len=64, max_position=64, vocab=512
    )
    with torch_threads(1):
        pack_copies(list(build_model("gpt2-tiny", 0, dropout=0.0, **cfg)), args.pack, args.repeats)
        engine_steps(cfg, args.minibatch, args.steps)


if __name__ == "__main__":
    main()
