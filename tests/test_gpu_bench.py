"""bench/gpu.py: the one-table GPU bench runs its whole path on the CPU with tiny
models (an emulated GPU for the engine, gloo for FSDP2), and without a GPU it
says so and exits 0."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch, capsys):
    # run as its command line runs it, in this process (a process of its own would
    # spend its seconds importing torch)
    bench = ROOT / "bench" / "gpu.py"
    monkeypatch.setattr(sys, "argv", [str(bench)])
    monkeypatch.syspath_prepend(str(bench.parent))
    try:
        runpy.run_path(str(bench), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    assert code == 0
    assert "torch sees no GPU" in capsys.readouterr().out


def test_the_tiny_cpu_run_fills_every_section_of_the_table(tmp_path):
    out = tmp_path / "gpu.md"
    done = run("--device", "cpu", "--tiny", "--out", str(out), timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.read_text().splitlines()[2:]
    ]
    by = {(r[0], r[1]): r[2] for r in rows}
    assert not [r for r in rows if r[1] == "error"], rows  # no section failed
    assert by[("a", "harmony / plain")].endswith("x")
    assert "resident" in [r[3] for r in rows if r[1] == "harmony plan='auto' step"][0]
    for system in (
        "harmony plan='auto'",
        "torch offload (TorchOffload)",
        "FSDP2 + CPUOffloadPolicy",
    ):
        assert by[("b", system)].endswith("samples/s"), (system, by[("b", system)])
    assert (
        by[("b", "DeepSpeed ZeRO-Offload")] in ("not installed",)
        or "samples/s" in by[("b", "DeepSpeed ZeRO-Offload")]
    )
    assert ("c", "(a) measured / simulated step") in by and ("c", "(b) peak memory") in by
    assert by[("d", "harmony-pp, 2 packs")] == by[("d", "resident")] == "bitwise"
    assert by[("d", "bf16: one-pack harmony-pp vs resident")] == "bitwise"
