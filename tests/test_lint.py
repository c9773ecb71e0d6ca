"""The code stays formatted and lint-clean under the project's ruff settings
(pyproject.toml: lines under 100 characters, pyflakes, import order)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["harmony", "tests", "bench"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module", autouse=True)
def needs_ruff():
    found = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    if found.returncode != 0:
        pytest.fail("ruff is missing: pip install -e '.[dev]' (make test does)")


def test_lint_clean():
    done = ruff("check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_formatted():
    done = ruff("format", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
