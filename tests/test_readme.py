"""Every command and code block of the README runs as written, on a fresh
checkout: the Python blocks in order in one namespace (as a reader pastes them
into one session), the shell commands in a scratch directory with the
project's environment on the PATH, long runs with small step counts. The
benchmarks the README lists run too, marked slow (``make test-all``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: commands not run here, and why
NOT_RUN = {
    "make figures": (
        "the main job (minutes); CI runs `make test`, and the notebook tests run every notebook"
    ),
    "make test": "this very suite",
}
#: a long run made short: (pattern, replacement)
SMALL = [(r"--steps \d+", "--steps 2"), (r"--checkpoint-every \d+", "--checkpoint-every 1")]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(" ".join(shlex.quote(w) for w in words))
    return out


def shell_commands() -> list[str]:
    return [c for b in blocks("bash") for c in commands(b)]


def small(command: str) -> str:
    for pattern, replacement in SMALL:
        command = re.sub(pattern, replacement, command)
    return command


def run(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_readme_has_what_this_test_runs():
    assert len(blocks("python")) >= 4 and any(c.startswith("torchrun") for c in shell_commands())
    assert {c for c in shell_commands() if c.startswith("make ")} == set(NOT_RUN)


def test_every_file_the_readme_links_or_shows_exists():
    linked = re.findall(r'(?:src|href)="([^":]+)"|\]\(([^):#]+)\)', README)
    paths = {a or b for a, b in linked}
    assert {"figures/17_systems.png", "figures/17_systems.svg"} <= paths
    assert not [p for p in sorted(paths) if not (ROOT / p).exists()]


def test_python_blocks_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks("python")):
        try:
            exec(compile(block, f"README python block {i + 1}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - reported with the block
            pytest.fail(f"README python block {i + 1} fails: {type(e).__name__}: {e}\n{block}")


def files_named(command: str) -> set[str]:
    """The words of ``command`` that name files (``plan.json``, ``run/``)."""
    return {w for w in shlex.split(command) if not w.startswith("-") and ("." in w or "/" in w)}


def shell_chains() -> list[list[str]]:
    """The README's shell commands run here (benchmarks and :data:`NOT_RUN` left
    out), in chains: a command joins the chain of an earlier command of its block
    that names a file it names too (``--save-plan plan.json``, then ``--plan
    plan.json``); the others start chains of their own, which run apart."""
    chains: list[list[str]] = []
    for block in blocks("bash"):
        mine: list[list[str]] = []
        for c in commands(block):
            if c in NOT_RUN or c.startswith(".venv/bin/python bench/"):
                continue
            chain = next(
                (ch for ch in mine if any(files_named(c) & files_named(o) for o in ch)), None
            )
            if chain is None:
                mine.append(chain := [])
            chain.append(c)
        chains += mine
    return chains


CHAINS = shell_chains()


def heavy(chain: list[str]) -> bool:
    """A chain on the paper's model, or training with state on disk: tens of seconds."""
    return any("gpt2-xl" in c or ("--host-memory" in c and " train " in f" {c} ") for c in chain)


@pytest.mark.parametrize(
    "chain",
    [pytest.param(ch, marks=pytest.mark.heavy) if heavy(ch) else ch for ch in CHAINS],
    ids=[" ".join(ch[0].split()[:3]) for ch in CHAINS],
)
def test_shell_commands_run(chain, tmp_path):
    """A chain's commands in order, in a directory of its own."""
    for command in chain:
        done = run(small(command), tmp_path, timeout=600)
        assert done.returncode == 0, (
            f"`{small(command)}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )


def test_every_command_runs_in_one_chain():
    run_here = [
        c
        for c in shell_commands()
        if c not in NOT_RUN and not c.startswith(".venv/bin/python bench/")
    ]
    assert sorted(c for ch in CHAINS for c in ch) == sorted(run_here)
    plan = next(ch for ch in CHAINS if any("--save-plan plan.json" in c for c in ch))
    assert any("--plan plan.json" in c for c in plan[1:])


BENCHES = [c for c in shell_commands() if c.startswith(".venv/bin/python bench/")]


@pytest.mark.slow
@pytest.mark.parametrize("command", BENCHES, ids=[c.split("/")[-1] for c in BENCHES])
def test_benchmarks_run(command):
    done = run(
        command.replace(".venv/bin/python", shlex.quote(sys.executable), 1), ROOT, timeout=3600
    )
    assert done.returncode == 0, (
        f"`{command}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
