"""What a disk tier costs in simulation: GPT-2 XL, fp32, AdamW (the zoo's analytic
cost model) on the Harmony paper's 4 x GTX 1080 Ti server, with the host memory
of a commodity machine (``--host-memory``, 24 GiB) over a PCIe 4.0 NVMe drive
(``--disk``), against the same server with host memory to spare (the preset's
750 GB), side by side in one run.

1. The best plan the search finds with host memory to spare, simulated on both
   servers: seconds per iteration and their ratio; what the placement puts on
   disk; the disk bytes per iteration, simulated and in closed form, and their
   ratio (1.0: the graph moves what the formula says); the disk's time
   (bytes over bandwidth) and the lower bound against the iteration.
2. Gradients in two pack slots (Harmony's policies, where the whole model's do
   not fit) against the whole model's gradients in host memory (the policies'
   ``GRADIENT_WINDOW`` turned off: ``harmony.policies.without_gradient_slots``),
   the plan of 1 on the short server: what goes to disk, seconds per
   iteration, their ratio.
3. The search run on the short-memory server itself: its best plan's seconds
   per iteration against the best with memory to spare.
4. Harmony's pipeline on one GPU (harmony-pp, the best such plan with memory
   to spare) on a server short enough to put master weights on disk
   (``--weights-host-memory``): each pack's backward weight load taking its
   weights from its update's read against every load reading for itself
   (``harmony.policies.without_weights_with_update``): disk bytes per
   iteration (simulated and closed form) and seconds per iteration.

5. The plan of 1 on a host too short for its stashes even with all its state on
   disk (``--stashes-host-memory``): the stashes go to disk too; what is on
   disk, disk bytes (simulated and closed form) and seconds per iteration
   against the same plan on the short server and with memory to spare.

    python bench/disk_tier_sim.py [--minibatch 64] [--host-memory 24GiB] [--disk nvme]
        [--weights-host-memory 12GiB] [--stashes-host-memory 11GiB]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import harmony
from harmony.costs.catalog import model_spec
from harmony.costs.hardware import format_bytes, preset
from harmony.costs.placement import HostMemoryError
from harmony.graph import DISK_IN, DISK_OUT
from harmony.policies import (
    disk_placement,
    swap_volume,
    without_gradient_slots,
    without_weights_with_update,
)
from harmony.trace import Summary


def simulate(spec, hw, plan) -> Summary:
    return harmony.simulate(spec, hw, plan).summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--hardware", default="paper-4x1080ti")
    ap.add_argument("--minibatch", type=int, default=64)
    ap.add_argument("--host-memory", default="24GiB")
    ap.add_argument("--disk", default="nvme", help="'nvme' or read,write bandwidths")
    ap.add_argument("--workers", type=int, default=1, help="search processes")
    ap.add_argument(
        "--weights-host-memory", default="12GiB", help="section 4's host memory (weights on disk)"
    )
    ap.add_argument(
        "--stashes-host-memory", default="11GiB", help="section 5's host memory (stashes on disk)"
    )
    args = ap.parse_args()

    spec = model_spec(args.model, "zoo")
    roomy = preset(args.hardware)
    short = roomy.with_host_memory(args.host_memory).with_disk(args.disk)
    print(
        f"{spec.name} ({spec.num_params / 1e9:.2f} B parameters, {spec.param_dtype}, "
        f"{spec.optimizer}) on {roomy.name}, minibatch {args.minibatch}"
    )
    print(
        f"short server: host memory {format_bytes(short.host_memory)}, disk read "
        f"{format_bytes(short.disk_read)}/s, write {format_bytes(short.disk_write)}/s; "
        f"roomy: host memory {format_bytes(roomy.host_memory)}, no disk"
    )

    started = time.perf_counter()
    best = harmony.search(spec, roomy, args.minibatch, workers=args.workers)
    plan = first = best.iloc[0]["plan"]
    print(
        f"\n1. best plan with memory to spare ({time.perf_counter() - started:.0f} s of search):"
    )
    print(f"   {plan.describe()}")
    try:
        same_plan(spec, roomy, short, plan)
    except HostMemoryError as e:
        print(f"   does not fit the short server: {e}")

    print("\n2. gradients in slots against the whole model's, the plan of 1 on the short server:")
    slots_or_whole(spec, short, plan)

    started = time.perf_counter()
    try:
        chosen = harmony.search(spec, short, args.minibatch, workers=args.workers)
    except HostMemoryError as e:
        print(f"\n3. no plan the search tries fits the short server: {e}")
    else:
        searched(chosen, best, started)

    one = roomy.with_gpus(1)  # where the loads share the update's read (see disk_tier)
    pipeline = harmony.search(spec, one, args.minibatch, policies=["harmony-pp"])
    plan = pipeline.iloc[0]["plan"]
    shorter = one.with_host_memory(args.weights_host_memory).with_disk(args.disk)
    print(f"\n4. {plan.describe()} on {format_bytes(shorter.host_memory)} over the disk:")
    shared_read(spec, shorter, plan)

    shortest = roomy.with_host_memory(args.stashes_host_memory).with_disk(args.disk)
    print(f"\n5. the plan of 1 on {format_bytes(shortest.host_memory)} over the disk:")
    others = {
        f"{format_bytes(short.host_memory)} server": short,
        f"{format_bytes(shorter.host_memory)} server": shorter.with_gpus(roomy.n_gpus),
        "server with memory to spare": roomy,
    }
    stashes_too(spec, shortest, first, others)


def searched(chosen, best, started: float) -> None:
    """Section 3: the short server's best plan against the roomy one's."""
    row, ratio = chosen.iloc[0], chosen.iloc[0]["iteration_s"] / best.iloc[0]["iteration_s"]
    print(f"\n3. the search on the short server ({time.perf_counter() - started:.0f} s):")
    print(f"   {row['plan'].describe()}: {row['iteration_s']:.3f} s/iter, ", end="")
    print(f"disk {row['disk_gb']:.2f} GB read + written")
    print(
        f"   best s/iter short + disk / roomy: {ratio:.4f} "
        f"({chosen.attrs['rejected_host_memory']} candidates did not fit the host)"
    )


def same_plan(spec, roomy, short, plan) -> None:
    """``plan`` simulated on both servers: time, placement, disk bytes against the
    closed form, the disk's share of the iteration."""
    fast, spilled = simulate(spec, roomy, plan), simulate(spec, short, plan)
    placement = disk_placement(spec, short, plan)
    kinds = sorted({k for _, k in placement.on_disk})
    print(
        f"   on disk: {len(placement.on_disk)} (pack, kind) of {len(plan.bwd_packs)} packs "
        f"({', '.join(kinds) or 'nothing'}), {format_bytes(placement.disk_bytes)}; host holds "
        f"{format_bytes(placement.host_bytes)} (staging {format_bytes(placement.staging_bytes)},"
        f" stashes and gradients {format_bytes(placement.reserve)})"
    )
    print(
        f"   s/iter: roomy {fast.iteration_s:.3f}, short + disk {spilled.iteration_s:.3f}, "
        f"ratio {spilled.iteration_s / fast.iteration_s:.4f}"
    )
    closed = swap_volume(spec, plan, short)
    for kind, got in ((DISK_IN, spilled.disk_read_bytes), (DISK_OUT, spilled.disk_write_bytes)):
        want = closed.get(kind, 0.0)
        ratio = got / want if want else float("nan")
        print(
            f"   {kind:8s} simulated {got / 1e9:.3f} GB/iter, closed form {want / 1e9:.3f} GB, "
            f"ratio {ratio:.6f}"
        )
    disk_s = short.disk_seconds(spilled.disk_read_bytes, spilled.disk_write_bytes)
    print(
        f"   the disk's least time {disk_s:.3f} s/iter "
        f"({disk_s / spilled.iteration_s:.3f} x the iteration); "
        f"lower bound {spilled.lower_bound_s:.3f} s ({spilled.lower_bound_by}), "
        f"time / lower bound {spilled.time_over_lower_bound:.3f}"
    )


def slots_or_whole(spec, short, plan) -> None:
    rows = {}
    for name, ctx in (("slots", contextlib.nullcontext()), ("whole", without_gradient_slots())):
        with ctx:
            try:
                placement = disk_placement(spec, short, plan)
                rows[name] = (placement, simulate(spec, short, plan))
            except HostMemoryError as e:
                print(f"   {name}: does not fit: {e}")
    for name, (placement, summary) in rows.items():
        print(
            f"   {name}: gradient slots {placement.gradient_slots}, reserve (gradients, stashes) "
            f"{format_bytes(placement.reserve)}, on disk {len(placement.on_disk)} (pack, kind), "
            f"disk {(summary.disk_read_bytes + summary.disk_write_bytes) / 1e9:.2f} GB/iter, "
            f"{summary.iteration_s:.3f} s/iter"
        )
    if len(rows) == 2:
        ratio = rows["slots"][1].iteration_s / rows["whole"][1].iteration_s
        print(f"   s/iter slots / whole: {ratio:.4f}")


def shared_read(spec, short, plan) -> None:
    """``plan`` on ``short`` with each backward load taking its pack's weights
    from the update's read, against every load reading for itself."""
    rows = {}
    cases = (("shared", contextlib.nullcontext()), ("apart", without_weights_with_update()))
    for name, ctx in cases:
        with ctx:
            try:
                placement = disk_placement(spec, short, plan)
            except HostMemoryError as e:
                print(f"   {name}: does not fit: {e}")
                return
            closed = swap_volume(spec, plan, short)
            rows[name] = (placement, simulate(spec, short, plan), closed)
    for name, (placement, summary, closed) in rows.items():
        weights = sum(1 for _, k in placement.on_disk if k == "weights")
        print(
            f"   {name}: master weights of {weights} packs on disk; disk read "
            f"{summary.disk_read_bytes / 1e9:.2f} GB/iter (closed form "
            f"{closed.get(DISK_IN, 0.0) / 1e9:.2f}), written {summary.disk_write_bytes / 1e9:.2f};"
            f" {summary.iteration_s:.3f} s/iter ({summary.lower_bound_by})"
        )
    (_, shared, _), (_, apart, _) = rows["shared"], rows["apart"]
    print(
        f"   disk read shared / apart: {shared.disk_read_bytes / apart.disk_read_bytes:.4f}; "
        f"s/iter shared / apart: {shared.iteration_s / apart.iteration_s:.4f}"
    )


def stashes_too(spec, shortest, plan, others: dict) -> None:
    """``plan`` on ``shortest``, where its stashes go to disk too, against it on
    the ``others`` servers (by name)."""
    try:
        placement = disk_placement(spec, shortest, plan)
    except HostMemoryError as e:
        print(f"   does not fit: {e}")
        return
    summary, closed = simulate(spec, shortest, plan), swap_volume(spec, plan, shortest)
    kinds = sorted({k for _, k in placement.on_disk})
    print(
        f"   on disk: {', '.join(kinds) or 'no state'} of "
        f"{len({q for q, _ in placement.on_disk})} packs"
        + (
            f" and the stashes, {format_bytes(placement.stash_disk_bytes)} per iteration"
            if placement.stashes_on_disk
            else " (the stashes stay in host memory)"
        )
    )
    print(
        f"   disk read {summary.disk_read_bytes / 1e9:.2f} GB/iter (closed form "
        f"{closed.get(DISK_IN, 0.0) / 1e9:.2f}), written {summary.disk_write_bytes / 1e9:.2f} "
        f"(closed form {closed.get(DISK_OUT, 0.0) / 1e9:.2f}); {summary.iteration_s:.3f} s/iter "
        f"({summary.lower_bound_by})"
    )
    for name, hw in others.items():
        try:
            placed, other = disk_placement(spec, hw, plan), simulate(spec, hw, plan)
        except HostMemoryError:
            continue
        where = "on disk" if placed.stashes_on_disk else "in host memory"
        print(
            f"   on the {name} (stashes {where}, {len(placed.on_disk)} (pack, kind) on disk): "
            f"{other.iteration_s:.3f} s/iter; "
            f"here / there {summary.iteration_s / other.iteration_s:.4f}"
        )


if __name__ == "__main__":
    main()
