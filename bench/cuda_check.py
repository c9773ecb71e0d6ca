"""The engine on a real GPU: exactness (allclose to the reference loop run on the
same GPU), copy/compute overlap in the trace, allocations per step (new CUDA
segments, new page-locked host buffers: none after the first step), measured
peak memory vs the plan's simulated peak. Skips cleanly (exit 0) where torch sees no CUDA device.

    python bench/cuda_check.py [--hidden 1024] [--blocks 8]
"""

import argparse
import statistics
import sys
import time

import torch

import harmony
from harmony import Engine, Plan, reference_step
from harmony.workbench.training import build_model, lm_loss


def overlap_fraction(timeline) -> float:
    """Share of h2d transfer time that ran while the GPU computed."""
    comp = timeline[timeline.lane.str.endswith(".compute")][["start_s", "end_s"]].to_numpy()
    copies = timeline[timeline.lane.str.endswith(".h2d")][["start_s", "end_s"]].to_numpy()
    total = sum(e - s for s, e in copies)
    hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in copies for cs, ce in comp)
    return hidden / total if total else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device visible to torch; skipped")
        return 0
    cfg = dict(
        hidden=args.hidden,
        n_layer=args.blocks,
        heads=16,
        seq_len=256,
        max_position=256,
        vocab=8192,
    )
    B = args.minibatch
    (x,), y = harmony.zoo.example_input("gpt2-tiny", B, **cfg)
    loss = lm_loss
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731

    def build():
        return build_model("gpt2-tiny", 0, dropout=0.0, **cfg)

    n = args.blocks + 3
    packs = tuple((i, min(i + 2, n)) for i in range(0, n, 2))
    plan = Plan("harmony-pp", 1, B, 4, 4, packs[:-1], packs)
    engine = Engine(build(), opt, loss, device="cuda:0", minibatch_size=B, plan=plan)
    times, segments, host_buffers = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step(x, y)
        times.append(time.perf_counter() - t0)
        segments.append(
            torch.cuda.memory_stats()["segment.all.allocated"]
        )  # cudaMalloc calls so far
        host_buffers.append(engine.trace.summary.new_buffers)

    ref = build().cuda()
    ref_opt = opt(list(ref.parameters()))
    for step in range(args.steps):
        reference_step(list(ref), loss, ref_opt, (x.cuda(),), y.cuda(), 4, step)
    worst = max(
        (a.detach().cpu() - b.detach().cpu()).abs().max().item()
        for a, b in zip(engine.model.parameters(), ref.parameters())
    )
    s = engine.trace.summary
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"plan: {plan.describe()}; {statistics.median(times[1:]):.3f} s/step")
    print(f"max |engine - reference| after {args.steps} steps: {worst:.3e}")
    print(f"h2d time overlapped with compute: {overlap_fraction(engine.trace.timeline):.2%}")
    print(
        "steady state: cudaMalloc segments made per step after the first "
        f"{[b - a for a, b in zip(segments, segments[1:])]}, page-locked host buffers made per "
        f"step {host_buffers}"
    )
    print(
        f"peak device memory (ledger): {s.peak_memory['gpu0'] / 1e6:.1f} MB, "
        f"torch max_memory_allocated: {torch.cuda.max_memory_allocated() / 1e6:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
