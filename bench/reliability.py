"""Kill a training run with SIGKILL at random moments, resume it each time, and
check it ends bitwise equal to a run that was never interrupted.

``harmony train`` (gpt2-tiny on an emulated GPU with slow links, so a step
lasts long enough to be hit anywhere: in compute, in a copy, in an update or
while a checkpoint is being written) checkpoints every step; after each kill
every checkpoint on disk must read back whole, and ``--resume`` continues
from the newest.

    python bench/reliability.py [--kills 20] [--seed 0] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harmony import CheckpointDir, Plan, decompose
from harmony.engine.checkpoint import read_checkpoint
from harmony.workbench.training import build_model


def train_command(workdir: Path, out: Path, checkpoints: bool, steps: int) -> list[str]:
    """``harmony train`` for the run; with checkpoints every step and --resume."""
    plan = workdir / "plan.json"
    if not plan.exists():  # a fixed plan: no profiling at start, the same plan every launch
        n = len(decompose(build_model("gpt2-tiny")).layers)
        Plan("harmony-pp", 1, 8, 4, 4, ((0, 2),), ((0, 2), (2, n))).to_json(plan)
    args = [
        sys.executable,
        "-m",
        "harmony",
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        str(steps),
        "--minibatch",
        "8",
        "--memory",
        "4MB",
        "--h2d",
        "4MB/s",
        "--d2h",
        "4MB/s",
        "--plan",
        str(plan),
        "--save",
        str(out),
    ]
    if checkpoints:
        args += [
            "--checkpoint-dir",
            str(workdir / "run"),
            "--checkpoint-every",
            "1",
            "--keep",
            "2",
            "--resume",
        ]
    return args


def kill_and_resume(workdir: Path, kills: int, seed: int, steps: int = 8) -> dict:
    """Train ``steps`` steps through up to ``kills`` SIGKILLs (fewer if the run
    ends first); returns what happened."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(
        train_command(workdir, workdir / "whole.pt", False, steps),
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    rng = random.Random(seed)
    done = launches = checked = 0
    while True:
        launches += 1
        if launches > 3 * kills + 5:
            raise RuntimeError("the run never finished")
        proc = subprocess.Popen(
            train_command(workdir, workdir / "resumed.pt", True, steps),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(rng.randint(1, 4)):  # a random number of lines, then a random delay
            if not proc.stdout.readline():
                break
        time.sleep(rng.uniform(0.0, 0.3))
        if done < kills and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            proc.stdout.close()
            done += 1
            for path in CheckpointDir(workdir / "run").paths():
                read_checkpoint(path)  # raises if a kill left a damaged checkpoint
                checked += 1
            continue
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(out)
        break
    whole, resumed = torch.load(workdir / "whole.pt"), torch.load(workdir / "resumed.pt")
    equal = whole.keys() == resumed.keys() and all(
        torch.equal(whole[k], resumed[k]) for k in whole
    )
    return {
        "kills": done,
        "launches": launches,
        "checkpoints_checked": checked,
        "bitwise_equal": equal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = kill_and_resume(Path(tmp), args.kills, args.seed, args.steps)
    print(
        f"SIGKILLs survived: {r['kills']} in {r['launches']} launches "
        f"({time.perf_counter() - t0:.0f} s); checkpoints read back whole after the kills: "
        f"{r['checkpoints_checked']}; final weights bitwise equal to the uninterrupted run: "
        f"{r['bitwise_equal']}"
    )


if __name__ == "__main__":
    main()
