"""Running a notebook and saving it in place leaves ``git status`` clean: the clean
filter of ``.gitattributes`` (scripts/strip_notebook.py, registered by ``make``) drops
what a run writes, and the notebooks' outputs go to ignored folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import strip_notebook  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_are_as_the_filter_writes_them(path):
    """Else checking one out would show it modified before anyone ran it."""
    text = path.read_text()
    assert strip_notebook.dumps(strip_notebook.strip(json.loads(text))) == text


def _run_in_place(path: Path, out: Path) -> None:
    """What a run in Jupyter (or papermill in place) leaves in the file and beside it."""
    nb = nbformat.read(path, as_version=4)
    injected = nbformat.v4.new_code_cell(
        "quick = False", metadata={"tags": ["injected-parameters"]}
    )
    nb.cells.insert(1, injected)
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.metadata["execution"] = {"iopub.execute_input": "2026-11-27T10:00:00Z"}
        cell.metadata["papermill"] = {"duration": 0.5, "status": "completed"}
        cell.outputs = [
            nbformat.v4.new_output("stream", name="stdout", text="ran\n"),
            nbformat.v4.new_output("display_data", data={"text/html": "<div>chart</div>"}),
        ]
    nb.metadata["papermill"] = {"parameters": {"quick": False}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.metadata["language_info"].update(version="3.12.3", mimetype="text/x-python")
    nbformat.write(nb, path)
    out.mkdir(parents=True)
    (out / "results.json").write_text("{}")
    (path.parent / ".ipynb_checkpoints").mkdir(exist_ok=True)


def test_running_a_notebook_in_place_leaves_git_status_clean(tmp_path):
    repo = tmp_path / "repo"
    for name in (".gitattributes", ".gitignore", "scripts/strip_notebook.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    notebook = repo / "notebooks" / "00_quickstart.ipynb"
    notebook.parent.mkdir()
    shutil.copy(ROOT / "notebooks" / "00_quickstart.ipynb", notebook)
    _git(repo, "init", "-q")
    subprocess.run(
        [sys.executable, "scripts/strip_notebook.py", "--install"], cwd=repo, check=True
    )
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "notebooks")

    # the out_dir of the notebook's parameters cell, relative to the notebook as Jupyter runs it
    _run_in_place(notebook, notebook.parent / "out" / "00_quickstart")
    assert "outputs" in notebook.read_text() and '"ran\\n"' in notebook.read_text()
    assert _git(repo, "diff") == ""  # the filtered notebook is the committed one
    # git lists a file whose size changed until its index entry is refreshed (git's stat
    # check comes before any filter; nbstripout has the same); adding it stages nothing
    _git(repo, "add", "-A")
    assert _git(repo, "status", "--porcelain") == ""

    # without the filter registered the same run shows: the test can fail
    _git(repo, "config", "--unset", "filter.nbstrip.clean")
    _git(repo, "add", "--renormalize", ".")
    assert "00_quickstart.ipynb" in _git(repo, "status", "--porcelain")
