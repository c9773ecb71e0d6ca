"""``harmony train --host-memory/--disk-dir``: a run whose optimizer state goes to
a disk tier (by default under its checkpoint directory) checkpoints every
step, resumes from its checkpoint, and ends with the weights of the run kept
in memory, bitwise."""

from __future__ import annotations

import re

import pytest
import torch
from test_disk_tier_engine import state_alone

from harmony import Plan
from harmony.cli import main
from harmony.workbench.training import build_model

LAYERS = 8  # gpt2-tiny with 8 blocks: 11 layers, 1.74 MB of weights
SETS = ["--set", f"n_layer={LAYERS}", "--set", "dropout=0.0"]


@pytest.fixture(autouse=True)
def budgets_for_the_state_alone(monkeypatch):
    state_alone(monkeypatch.setattr)  # see tests/test_disk_tier_engine.py


@pytest.fixture
def plan_file(tmp_path):
    n = len(build_model("gpt2-tiny", 0, n_layer=LAYERS))
    packs = tuple((i, i + 1) for i in range(n))
    path = tmp_path / "plan.json"
    Plan("harmony-pp", 1, 4, 2, 2, packs[:-1], packs).to_json(path)
    return path


def weights_bytes() -> int:
    return sum(p.numel() * 4 for p in build_model("gpt2-tiny", 0, n_layer=LAYERS).parameters())


def run(plan_file, steps: int, *extra: str) -> None:
    argv = ["train", "--steps", str(steps), "--minibatch", "4", "--memory", "4MB"]
    assert main([*argv, "--plan", str(plan_file), *SETS, *extra]) == 0


def test_a_run_on_a_disk_tier_resumes_and_ends_as_the_run_in_memory(tmp_path, plan_file, capsys):
    run(plan_file, 4, "--save", str(tmp_path / "memory.pt"))
    ckpt = tmp_path / "run"
    # AdamW's state of every block on disk, the gradients in two pack slots (3.5x the
    # weights: tested placement)
    tier = ["--host-memory", str(int(3.5 * weights_bytes())), "--disk", "2GB/s,2GB/s"]
    common = [*tier, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    run(plan_file, 2, *common)
    out = capsys.readouterr().out
    assert f"disk tier {ckpt / 'disk-tier'}: optimizer of 10 packs; gradients in 2 pack" in out
    assert (ckpt / "disk-tier" / "manifest.json").exists()
    run(plan_file, 4, *common, "--resume", "--save", str(tmp_path / "tier.pt"))
    assert "resumed from" in capsys.readouterr().out
    a, b = torch.load(tmp_path / "memory.pt"), torch.load(tmp_path / "tier.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_a_checkpoint_directory_the_tier_is_temporary(tmp_path, plan_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(plan_file, 2, "--host-memory", str(int(4.5 * weights_bytes())), "--disk", "2GB/s,2GB/s")
    assert not list(tmp_path.glob(".harmony-disk-tier-*"))  # removed at the end


def test_a_tier_needs_a_checkpoint_every_step(tmp_path, plan_file, capsys):
    argv = ["train", "--plan", str(plan_file), "--host-memory", "8GB", "--disk-dir"]
    argv += [str(tmp_path / "tier"), "--checkpoint-dir", str(tmp_path / "run")]
    assert main([*argv, "--checkpoint-every", "2"]) == 2
    assert "checkpoint every step (--checkpoint-every 1)" in capsys.readouterr().err


def test_the_report_says_where_the_state_lives(tmp_path, plan_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(plan_file, 1, "--host-memory", "1GB")
    out = capsys.readouterr().out
    assert "host memory: budget 1 GB (the process besides the model and its devices" in out
    assert "all training state in host memory" in out


def test_a_budget_under_what_the_process_holds_is_refused_in_words(capsys, monkeypatch):
    import harmony.engine.auto_plan as planning

    # what the process holds besides the model, as plan="auto" sees it: 2 GB
    monkeypatch.setattr(planning, "besides_the_model", lambda module: 2 * 10**9)
    argv = ["train", "--steps", "1", "--minibatch", "4", "--memory", "4MB", *SETS]
    assert main([*argv, "--plan", "auto", "--host-memory", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "budget of 1 GB is not more than this process holds besides the model (2 GB" in err


def test_a_run_whose_stashes_go_to_disk_too_ends_as_the_run_in_memory(tmp_path, plan_file, capsys):
    """Samples of 256 tokens: the stashes outweigh the state, and a budget of 3.5x the
    weights sends them to disk beside every block's optimizer state."""
    seq = ["--set", "seq_len=256", "--set", "max_position=256", "--memory", "64MB"]
    run(plan_file, 2, *seq, "--save", str(tmp_path / "memory.pt"))
    tier = ["--host-memory", str(int(3.5 * weights_bytes())), "--disk", "2GB/s,2GB/s"]
    tier += ["--disk-dir", str(tmp_path / "tier"), "--save", str(tmp_path / "tier.pt")]
    run(plan_file, 2, *seq, *tier)
    out = capsys.readouterr().out
    assert "optimizer of 11 packs; the stashes; gradients in 2 pack slots" in out
    a, b = torch.load(tmp_path / "memory.pt"), torch.load(tmp_path / "tier.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_plan_a_disk_tier_run_picked_runs_again_in_memory_to_the_same_weights(
    tmp_path, capsys, monkeypatch
):
    """plan='auto' under a budget of 3.5x the weights puts state on disk; --save-plan
    writes the plan it picked, and --plan runs it again without a budget."""
    import harmony.engine.auto_plan as planning

    monkeypatch.setattr(planning, "besides_the_model", lambda module: 0)  # the state alone
    argv = ["train", "--steps", "2", "--minibatch", "2", "--memory", "4MB", *SETS]
    tier = ["--host-memory", str(int(3.5 * weights_bytes())), "--disk", "2GB/s,2GB/s"]
    tier += ["--disk-dir", str(tmp_path / "tier"), "--save-plan", str(tmp_path / "plan.json")]
    assert main([*argv, *tier, "--save", str(tmp_path / "tier.pt")]) == 0
    assert re.search(r"disk tier \S+: optimizer", capsys.readouterr().out)  # state on disk
    plan = ["--plan", str(tmp_path / "plan.json")]
    assert main([*argv, *plan, "--save", str(tmp_path / "memory.pt")]) == 0
    a, b = torch.load(tmp_path / "memory.pt"), torch.load(tmp_path / "tier.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
