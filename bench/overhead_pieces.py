"""Two pieces of the engine's own overhead per step, measured on their own, on the
model and per-layer plan of ``bench/overhead.py`` (torch.optim.AdamW, one thread):

* the saved-tensor meter (:class:`harmony.engine.meters.SavedBytes`): its hook run
  over every tensor autograd saves in one step's forwards, each layer, each microbatch
  (what a device that measures pays; the cpu backend no longer does);
* the rollback journal (:class:`harmony.engine.journal.UpdateJournal`): the copies
  of every pack's weights and AdamW state an update journals first (what a step
  short of its point of no return pays).

Process CPU time, the median [min-max] of ``--repeats`` repetitions.

    python bench/overhead_pieces.py [--repeats 30] [--hidden 256] [--blocks 4]
"""

import argparse
import os
import statistics
import time

import torch

import harmony
from harmony import Engine, Plan
from harmony.engine.devices import Ledger
from harmony.engine.journal import UpdateJournal
from harmony.engine.meters import SavedBytes, WorkMeter
from harmony.workbench.training import build_model, lm_loss

SHAPE = dict(heads=4, seq_len=64, max_position=64, vocab=512)


def timed(work, repeats: int) -> str:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        work()
        times.append((time.process_time() - t0) * 1e3)
    return f"{statistics.median(times):.2f} ms/step [{min(times):.2f}-{max(times):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    B, u, size = 16, 4, dict(hidden=args.hidden, n_layer=args.blocks, **SHAPE)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", B, **size)
    model = build_model("gpt2-tiny", 0, dropout=0.0, **size)
    packs = tuple((i, i + 1) for i in range(len(model)))
    plan = Plan("harmony-pp", 1, B, u, u, packs[:-1], packs)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    engine = Engine(model, adamw, lm_loss, "cpu", B, plan)
    for _ in range(2):  # the optimizers' state made
        engine.step(x, y)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        for k in range(0, B, u):
            h = (x[k : k + u],)
            for layer in model:
                h = layer(*h)
                h = h if isinstance(h, tuple) else (h,)
    weights = list(model.parameters())

    def hooks():
        meter = SavedBytes(WorkMeter(Ledger("gpu0", None), 1e12, "a step").charge, weights)
        for t in saved:
            meter.pack_hook(t)

    journal = UpdateJournal()
    optimizers = [(key, opt) for key, opt in engine.optimizers.items() if opt is not None]
    for p in weights:  # a gradient, as an update has one (the copies do not read it)
        p.grad = torch.zeros_like(p)

    def copies():
        journal.start_step()
        for key, opt in optimizers:
            journal.record(key, opt)

    print(f"model: GPT-2 style, {args.blocks} blocks x {args.hidden}; {len(model)} packs")
    hooked = timed(hooks, args.repeats)
    print(f"saved-tensor hooks over the {len(saved)} tensors a step saves: {hooked}")
    print(f"journal copies of {len(optimizers)} packs: {timed(copies, args.repeats)}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
