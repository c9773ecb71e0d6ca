"""``harmony``: search, simulate, list what is known, reproduce the figures.

    harmony search   --model gpt2-xl --hardware paper-4x1080ti --minibatch 64
    harmony simulate --model gpt2-xl --hardware paper-4x1080ti --plan plan.json --chrome out.json
    harmony simulate --model gpt2-xl --minibatch 64 --host-memory 24GiB --disk nvme
    harmony train    --model gpt2-tiny --steps 20 --minibatch 16 --memory 2MB
                     (torchrun: one server per process)
    harmony models | presets | policies
    harmony reproduce --quick --out figures

Every error from bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import cli_args
from .errors import HarmonyError


def build_parser():
    """The ``harmony`` command's argument parser (:mod:`harmony.cli_args`)."""
    return cli_args.build_parser(__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except HarmonyError as e:
        print(f"harmony {args.command}: error: {e}", file=sys.stderr)
        return 2


def _spec_and_hw(args):
    from .costs.catalog import model_spec
    from .costs.hardware import parse_bytes, parse_disk, preset

    hw = preset(args.hardware)
    if args.host_memory is not None:
        hw = hw.with_host_memory(parse_bytes(args.host_memory, "--host-memory"))
    if args.disk is not None:
        hw = hw.with_disk(parse_disk(args.disk, "--disk"))
    return model_spec(args.model, args.source), hw


def _cmd_search(args) -> int:
    from . import search
    from .workbench.report import format_search

    spec, hw = _spec_and_hw(args)
    kwargs = {}
    if args.policies:
        kwargs["policies"] = args.policies
    df = search(
        spec,
        hw,
        args.minibatch,
        n_gpus=args.gpus,
        progress=not (args.no_progress or args.json),
        workers=args.workers,
        precision=args.precision,
        **kwargs,
    )
    if args.save_plan:
        df.iloc[0]["plan"].to_json(args.save_plan)
    if args.json:
        out = df.head(args.top).assign(plan=lambda d: d["plan"].map(lambda p: p.to_dict()))
        print(
            json.dumps(
                {"attrs": df.attrs, "rows": out.to_dict(orient="records")}, indent=2, default=str
            )
        )
    else:
        print(format_search(df, args.top))
    return 0


def _cmd_simulate(args) -> int:
    from . import search, simulate
    from .plan import Plan
    from .workbench.report import format_summary

    spec, hw = _spec_and_hw(args)
    if args.plan is not None:
        if args.policy is not None:
            raise HarmonyError("give --plan or --policy, not both: the plan names its policy")
        plan = Plan.from_json(args.plan)
        if args.precision is not None:
            plan = plan.with_options(precision=args.precision)
    elif args.minibatch is not None and args.policy is not None:
        from .planner import plan_for

        if args.precision is not None:
            spec = spec.in_precision(args.precision)
        plan = plan_for(args.policy, spec, hw, args.minibatch)
    elif args.minibatch is not None:
        plan = search(spec, hw, args.minibatch, progress=False, precision=args.precision).iloc[0][
            "plan"
        ]
    else:
        raise HarmonyError(
            "give --plan plan.json, or --minibatch N to simulate the best plan found"
        )
    trace = simulate(spec, hw, plan)
    if args.chrome:
        trace.to_chrome(args.chrome)
    if args.csv:
        trace.timeline.to_csv(args.csv, index=False)
    if args.timeline:
        from .workbench.charts import save, timeline_chart

        save(
            timeline_chart(trace, title=f"{spec.name} on {hw.name}: {plan.describe()}"),
            args.timeline,
        )
    if args.json:
        print(
            json.dumps(
                {"plan": plan.to_dict(), "summary": trace.summary.to_dict()}, indent=2, default=str
            )
        )
    else:
        print(format_summary(plan, trace))
        for line in _host_memory_lines(spec, hw, plan):
            print(line)
        if trace.summary.disk_bytes:
            print(_disk_line(trace.summary, hw))
    return 0


def _host_memory_lines(spec, hw, plan) -> list[str]:
    """What holding the gradients in slots and the stashes on disk save, where
    the placement does so."""
    from .costs.hardware import format_bytes
    from .costs.placement import STASH_SLOTS
    from .policies import disk_placement, spec_for
    from .policies.state import host_state
    from .policies.tier_placement import stashes_in_flight, windowed_gradients

    placement = disk_placement(spec, hw, plan)
    spec = spec_for(spec, plan)
    lines = []
    if placement.gradient_slots:
        whole = sum(host_state(spec, range(*p)).gradients for p in plan.bwd_packs)
        lines.append(
            f"host memory: gradients held in {placement.gradient_slots} pack slots, "
            f"{format_bytes(windowed_gradients(spec, plan))} (the whole model's: "
            f"{format_bytes(whole)})"
        )
    if placement.stashes_on_disk:
        held = stashes_in_flight(spec, plan)
        lines.append(
            f"host memory: stashes and offloaded activations on disk, "
            f"{format_bytes(placement.stash_disk_bytes)} per iteration, {STASH_SLOTS} per GPU "
            f"each way in host memory, {format_bytes(held)}"
        )
    return lines


def _disk_line(summary, hw) -> str:
    """What the disk tier moved, next to what the disk can do."""
    from .costs.hardware import format_bytes

    busy = hw.disk_seconds(summary.disk_read_bytes, summary.disk_write_bytes)
    sharing = "sharing its time" if hw.disk_shared else "each at once"
    return (
        f"disk tier: read {format_bytes(summary.disk_read_bytes)}, write "
        f"{format_bytes(summary.disk_write_bytes)} per iteration (at least {busy:.3g} s of disk "
        f"time at {format_bytes(hw.disk_read)}/s read, {format_bytes(hw.disk_write)}/s write, "
        f"{sharing}; host memory {format_bytes(hw.host_memory)})"
    )


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise HarmonyError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _cmd_train(args) -> int:
    from .engine.checkpoint import CheckpointDir
    from .engine.distributed import leave_process_group
    from .plan import Plan
    from .workbench.training import HostOptions, device_from_args

    device = device_from_args(args.gpus, args.memory, args.h2d, args.d2h, args.uplink, args.p2p)
    plan = "auto" if args.plan == "auto" else Plan.from_json(Path(args.plan))
    checkpoints = (
        CheckpointDir(args.checkpoint_dir, keep=args.keep) if args.checkpoint_dir else None
    )
    host = HostOptions(args.host_memory, args.disk_dir, args.disk)
    finished = False
    try:
        code = _train_and_report(args, device, plan, checkpoints, host)
        finished = True
        return code
    finally:
        host.close()
        leave_process_group(finished)


def _train_and_report(args, device, plan, checkpoints, host) -> int:
    from .costs.hardware import format_bytes
    from .workbench.training import save_weights, train

    result = train(
        args.model,
        args.steps,
        args.minibatch,
        device,
        plan,
        lr=args.lr,
        seed=args.seed,
        timeout_s=args.timeout,
        checkpoints=checkpoints,
        checkpoint_every=args.checkpoint_every or 0,
        resume=args.resume,
        precision=args.precision,
        nonfinite=args.nonfinite,
        host=host,
        **_overrides(args.set),
    )
    try:
        if args.save:
            save_weights(result.engine, args.save)
        if args.save_plan and result.engine.plan is not None:
            result.engine.plan.to_json(args.save_plan)
    finally:
        result.engine.close()
    if result.losses:
        print(
            f"{result.samples_per_s:.1f} samples/s after the first step; final loss "
            f"{result.losses[-1]:.6f}"
        )
    else:
        print(f"nothing to do: the run had already done its {args.steps} steps")
    disk = result.engine.disk
    if args.host_memory is not None:
        budget = result.engine.host_settings.budget
        where = "all training state in host memory"
        if disk is not None:
            on_disk = disk.placement.on_disk
            where = f"disk tier {disk.tier.directory}: " + (
                f"{', '.join(sorted({k for _, k in on_disk}))} of "
                f"{len({q for q, _ in on_disk})} packs"
                if on_disk
                else "no training state"
            )
            if disk.placement.stashes_on_disk:
                where += "; the stashes"
        slots = result.engine.gradient_slots
        if slots is not None:
            where += f"; gradients in {len(slots)} pack slots ({format_bytes(slots.nbytes)})"
        outside = sum(result.engine.host_settings.outside.values())
        peak = f", ledger peak {format_bytes(budget.peak)}" if disk is not None else ""
        print(
            f"host memory: budget {format_bytes(budget.capacity)} (the process besides the "
            f"model and its devices {format_bytes(outside)}){peak}; {where}"
        )
    return 0


def _cmd_models(args) -> int:
    from .costs import reference, zoo

    for name in sorted(set(reference.VARIANTS) | set(zoo.MODELS)):
        sources = [
            s
            for s, table in (("reference", reference.VARIANTS), ("zoo", zoo.MODELS))
            if name in table
        ]
        print(f"{name:16s} {', '.join(sources)}")
    return 0


def _cmd_presets(args) -> int:
    from .costs.hardware import PRESETS

    for hw in PRESETS.values():
        print(
            f"{hw.name:16s} {hw.n_gpus} GPU x {hw.gpu_memory / 1e9:.1f} GB, host link "
            f"{hw.h2d / 1e9:.1f} GB/s ({hw.gpus_per_switch} per uplink), p2p "
            f"{'-' if hw.p2p is None else f'{hw.p2p / 1e9:.1f} GB/s'}  {hw.notes}"
        )
    return 0


def _cmd_policies(args) -> int:
    from .policies import POLICIES

    for name, mod in POLICIES.items():
        print(f"{name:16s} {(mod.__doc__ or '').strip().splitlines()[0]}")
    return 0


def _cmd_reproduce(args) -> int:
    from .workbench.reproduce import list_experiments, reproduce

    if args.list:
        print(list_experiments())
        return 0
    report = reproduce(
        args.names or None, full=args.full, out=args.out, force=args.force, timeout=args.timeout
    )
    return report.exit_code


_COMMANDS = {
    "search": _cmd_search,
    "simulate": _cmd_simulate,
    "train": _cmd_train,
    "models": _cmd_models,
    "presets": _cmd_presets,
    "policies": _cmd_policies,
    "reproduce": _cmd_reproduce,
}

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
