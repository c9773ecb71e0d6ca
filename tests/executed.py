"""Each notebook run once per test session through papermill, with the
parameters its tests give it (:func:`test_notebooks.smoke_parameters`), and
shared by the tests that look at it: its outputs and printed results
(``test_notebooks``, ``test_lessons``) and its charts in a browser
(``test_browser``). Workers of ``pytest -n`` share the runs too: the first to
ask for a notebook runs it, under a lock, and the others read what it wrote.
A run that fails is not kept: the next test that asks runs it again, and fails
with its own traceback."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from harmony.workbench.reproduce import kernel_manager_class

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Executed:
    notebook: Path  #: the executed copy, with its outputs
    out: Path  #: the directory it wrote its results and figures to


def shared_directory(tmp_path_factory) -> Path:
    """A directory all workers of this session see (pytest's base temporary
    directory is per worker under ``pytest -n``; its parent is the session's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "executed"


def execute_once(path: Path, params: dict, root: Path) -> Executed:
    """``path`` executed with ``params`` (``out_dir`` set here), once per ``root``."""
    import papermill

    key = json.dumps([str(path.resolve()), params], sort_keys=True, default=str)
    home = root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    home.mkdir(parents=True, exist_ok=True)
    done = Executed(home / path.name, home / "out")
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (home / "ok").exists():
            papermill.execute_notebook(
                str(path),
                str(done.notebook),
                parameters={**params, "out_dir": str(done.out)},
                kernel_name="python3",
                kernel_manager_class=kernel_manager_class(),  # no transport warning per run
                cwd=str(ROOT),
                progress_bar=False,
                log_output=False,
            )
            (home / "ok").touch()
    return done
