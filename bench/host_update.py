"""What one host update (UPD) costs, part by part, on this machine's CPU.

A UPD checks its pack's gradients are finite, journals what it will change
(``safe_updates``: parameters and both AdamW moments copied, unless the step is
past its point of no return) and steps :class:`~harmony.FlatAdamW`. This times
each part on a pack shaped like three GPT-2 blocks of width 2048 (150 M
parameters by default), side by side in one run: the finiteness check as the
engine makes it (a sum per tensor) against the 2-norm it made before, the
journal's copies, the step, and a journaled update against one past the point
of no return.

    python bench/host_update.py [--elements 150e6] [--width 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harmony import FlatAdamW
from harmony.engine.journal import UpdateJournal, check_finite_gradients


def block(h: int) -> list[int]:
    """The tensors of one GPT-2 block of width ``h``: attention in, its bias, out, its
    bias, MLP in, bias, MLP out, bias, two LayerNorms."""
    return [h * 3 * h, 3 * h, h * h, h, h * 4 * h, 4 * h, 4 * h * h, h, h, h]


def median_s(fn, repeats: int = 3) -> float:
    fn()  # warm-up: pages touched, kernels chosen
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=150e6, help="parameters in the pack")
    ap.add_argument("--width", type=int, default=2048, help="the GPT-2 blocks' width")
    args = ap.parse_args()
    sizes: list[int] = []
    while sum(sizes) < args.elements:
        sizes += block(args.width)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(sizes)
    opt = FlatAdamW(params, lr=1e-4)
    opt.step()  # the moments exist, as from a run's second step on
    grads = [p.grad for p in params]
    journal = UpdateJournal()

    def journaled():
        journal.start_step()
        check_finite_gradients(opt, (0, 1))
        journal.record(0, opt)
        opt.step()

    def past_no_return():
        check_finite_gradients(opt, (0, 1))
        opt.step()

    parts = {
        "finite check, a sum per tensor (now)": median_s(
            lambda: check_finite_gradients(opt, (0, 1))
        ),
        "finite check, 2-norms (before)": median_s(lambda: torch._foreach_norm(grads, 2.0)),
        "journal: parameters and moments copied": median_s(lambda: journal.record(0, opt)),
        "FlatAdamW step": median_s(opt.step),
        "update, journaled": median_s(journaled),
        "update, past the point of no return": median_s(past_no_return),
    }
    print(
        f"{torch.get_num_threads()} torch threads; {len(sizes)} tensors, {n / 1e6:.0f} M elements"
    )
    for name, s in parts.items():
        print(f"  {name:42s} {s * 1e3:8.1f} ms")
    before, now = (
        parts["finite check, 2-norms (before)"],
        parts["finite check, a sum per tensor (now)"],
    )
    print(f"RATIO finite check 2-norm / sum: {before / now:.2f}x")
    ratio = parts["update, journaled"] / parts["update, past the point of no return"]
    print(f"RATIO journaled update / update past the point of no return: {ratio:.2f}x")


if __name__ == "__main__":
    main()
