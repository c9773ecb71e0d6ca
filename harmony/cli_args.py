"""The ``harmony`` command line's arguments: one parser per subcommand, and the
types that check what is typed (see :mod:`harmony.cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    return [_positive_int(x) for x in text.split(",") if x.strip()]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name (see `harmony models`)")
    p.add_argument(
        "--source",
        default="auto",
        choices=["auto", "reference", "zoo"],
        help=(
            "cost model: measured 1080 Ti profile (reference), analytic (zoo), "
            "or reference if any (auto)"
        ),
    )
    p.add_argument(
        "--hardware", default="paper-4x1080ti", help="hardware preset (see `harmony presets`)"
    )
    p.add_argument(
        "--json", action="store_true", help="print machine-readable JSON instead of tables"
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="plan a run in this precision (mixed: half the bytes on every link, float32 master "
        "weights on the host; default: the cost model's, or the plan's)",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="host memory for training state and stashes, e.g. 24GiB (default: the preset's); "
        "what does not fit goes to the disk tier (--disk)",
    )
    p.add_argument(
        "--disk",
        default=None,
        metavar="DISK",
        help="a disk tier under host memory: 'nvme' (PCIe 4.0 NVMe spec sheet) or read,write "
        "bandwidths, e.g. 3GB/s,2GB/s, with ',shared' after them where reads and writes share "
        "the disk's time (default: none: the state must fit host memory)",
    )


def build_parser(description: str) -> argparse.ArgumentParser:
    """The ``harmony`` command line: one subcommand per verb."""
    parser = argparse.ArgumentParser(prog="harmony", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_search(sub)
    _add_simulate(sub)
    _add_train(sub)
    sub.add_parser("models", help="list models")
    sub.add_parser("presets", help="list hardware presets")
    sub.add_parser("policies", help="list policies")
    _add_reproduce(sub)
    return parser


def _add_search(sub) -> None:
    s = sub.add_parser("search", help="rank plans by simulated iteration time")
    _add_model_args(s)
    s.add_argument("--minibatch", type=_positive_int, required=True, help="samples per iteration")
    s.add_argument(
        "--policies",
        type=_str_list,
        default=None,
        help="comma-separated policies (default: harmony-pp,harmony-dp,harmony-no-grouping)",
    )
    s.add_argument(
        "--gpus", type=_int_list, default=None, help="comma-separated GPU counts (default: all)"
    )
    s.add_argument("--top", type=_positive_int, default=10, help="rows to show")
    s.add_argument("--save-plan", type=Path, default=None, help="write the best plan as JSON")
    s.add_argument("--workers", type=_positive_int, default=None, help="simulation processes")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_simulate(sub) -> None:
    m = sub.add_parser("simulate", help="simulate one plan (or the best one found) and report")
    _add_model_args(m)
    m.add_argument(
        "--plan", type=Path, default=None, help="plan JSON (default: search at --minibatch)"
    )
    m.add_argument(
        "--minibatch",
        type=_positive_int,
        default=None,
        help="search at this minibatch if no --plan",
    )
    m.add_argument(
        "--policy",
        default=None,
        help="simulate this system's best plan at --minibatch (see `harmony policies`)",
    )
    m.add_argument("--chrome", type=Path, default=None, help="write a Chrome/Perfetto trace JSON")
    m.add_argument(
        "--timeline", type=Path, default=None, help="write a timeline figure (.svg and .png)"
    )
    m.add_argument("--csv", type=Path, default=None, help="write the timeline as CSV")


def _add_train(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a zoo model on synthetic data with the engine (torchrun: across servers)",
    )
    t.add_argument("--model", default="gpt2-tiny", help="zoo model (see `harmony models`)")
    t.add_argument("--steps", type=_positive_int, default=10)
    t.add_argument(
        "--minibatch", type=_positive_int, default=16, help="samples per step per server"
    )
    t.add_argument("--gpus", type=_positive_int, default=1, help="emulated GPUs in this server")
    t.add_argument("--memory", default="4MB", help="memory of each emulated GPU")
    t.add_argument("--h2d", default="200MB/s", help="host->GPU bandwidth of each emulated GPU")
    t.add_argument("--d2h", default="200MB/s", help="GPU->host bandwidth of each emulated GPU")
    t.add_argument("--uplink", default=None, help="shared host uplink of the emulated GPUs")
    t.add_argument("--p2p", default=None, help="GPU->GPU bandwidth (default: through host memory)")
    t.add_argument("--plan", default="auto", help="plan JSON file, or 'auto' (profile and search)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    _add_train_output_args(t)
    _add_train_run_args(t)
    _add_disk_tier_args(t)


def _add_train_output_args(t: argparse.ArgumentParser) -> None:
    """``train``'s config overrides, saved weights and checkpoints."""
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a zoo config field, e.g. --set n_layer=4 --set dropout=0.0",
    )
    t.add_argument(
        "--save", type=Path, default=None, help="write the final weights (torch.save state_dict)"
    )
    t.add_argument(
        "--save-plan",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the plan the run used as JSON: --plan FILE runs the same plan again "
        "(e.g. in host memory, to compare the weights with a run on a disk tier)",
    )
    t.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="directory for checkpoints of this run"
    )
    t.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        metavar="N",
        help="write a checkpoint every N steps (needs --checkpoint-dir)",
    )
    t.add_argument(
        "--keep", type=_positive_int, default=3, help="checkpoints to keep (the newest)"
    )


def _add_train_run_args(t: argparse.ArgumentParser) -> None:
    """``train``'s precision, what a non-finite step does, resuming, the servers' timeout."""
    t.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="mixed precision: weights, activations and gradients cross the links in this dtype",
    )
    t.add_argument(
        "--nonfinite",
        default="raise",
        choices=["raise", "skip"],
        help="a NaN/inf loss or gradient: stop (weights untouched) or skip the step",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest good checkpoint in --checkpoint-dir (if there is one)",
    )
    t.add_argument(
        "--timeout", type=float, default=60.0, help="seconds before a lost server is an error"
    )


def _add_disk_tier_args(t: argparse.ArgumentParser) -> None:
    """``train``'s host memory budget and the disk tier under it."""
    t.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="the process's host memory budget, e.g. 8GB (default: what the machine has); "
        "training state beyond it goes to a disk tier",
    )
    t.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="the disk tier's directory (default with --host-memory: disk-tier/ in "
        "--checkpoint-dir, else a temporary one in the working directory)",
    )
    t.add_argument(
        "--disk",
        default=None,
        metavar="READ,WRITE[,shared]",
        help="pace the disk tier to this link, e.g. 200MB/s,200MB/s, or 200MB/s,200MB/s,shared "
        "where reads and writes share the disk's time (default: measured)",
    )


def _add_reproduce(sub) -> None:
    r = sub.add_parser(
        "reproduce", help="run the experiments (notebooks through papermill), write figures"
    )
    r.add_argument(
        "names", nargs="*", help="experiments to run, by name or unique prefix (default: all)"
    )
    size = r.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CPU-sized parameters (the default)")
    size.add_argument("--full", action="store_true", help="the paper-sized parameters")
    r.add_argument(
        "--force", action="store_true", help="re-run experiments already done with the same code"
    )
    r.add_argument(
        "--out", type=Path, default=Path("figures"), help="where figures and their data go"
    )
    r.add_argument("--list", action="store_true", help="list the experiments and exit")
    r.add_argument("--timeout", type=float, default=None, help="seconds allowed per notebook cell")
