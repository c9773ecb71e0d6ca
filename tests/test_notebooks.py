"""The notebooks run through papermill with smoke parameters, write their results
and figures, and are committed clean (no outputs, a ``parameters`` cell)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

#: parameters smaller than quick mode where quick mode takes more than a few seconds
SMOKE: dict[str, dict] = {
    "00_quickstart": {"steps": 2, "run_baseline": False},
    "10_swap_volume": {"models": ["gpt2-xl"], "minibatches": [16]},
    "11_throughput": {"models": ["gpt2-xl"], "minibatches": [16]},
    "12_pack_vs_microbatch": {"minibatch": 16, "pack_sizes": [1, 7], "microbatches": [1, 4, 16]},
    "13_planner_table": {"models": ["gpt2-xl"], "minibatch": 16},
    "14_scaling": {"models": ["gpt2-10b"], "gpu_counts": [1, 2], "minibatch": 4},
    "15_exact_match": {"steps": 2},
    "16_simulator_fidelity": {"steps": 1, "pack_sizes": [3], "microbatches": [8]},
    "17_systems": {"models": ["gpt2-xl"], "minibatches": [16], "depths": [24, 48], "steps": 1},
    "18_vs_torch": {"hidden": 64, "blocks": 2, "minibatch": 8, "memory": "2MB", "steps": 1},
    "19_ablation_ladder": {"models": ["bert-96"], "minibatch": 16},
}
#: notebooks that take long even with smoke parameters (run with -m slow)
SLOW: set[str] = set()
#: the paper's figures and the systems' comparisons whose smoke run takes 10 s or more
#: on a quiet 2-core machine (25-60 s each under load): run by make heavy, which CI runs
#: after make test, so that make test stays about 10 minutes
HEAVY = {
    "10_swap_volume",
    "11_throughput",
    "13_planner_table",
    "14_scaling",
    "15_exact_match",
    "16_simulator_fidelity",
    "17_systems",
    "18_vs_torch",
    "19_ablation_ladder",
    "20_disk_tier",
}


def parameters_cell(nb) -> nbformat.NotebookNode | None:
    return next(
        (c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])), None
    )


def parameter_names(path: Path) -> set[str]:
    """Names assigned in the notebook's ``parameters`` cell (parsed, not run)."""
    cell = parameters_cell(nbformat.read(path, as_version=4))
    names = set()
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _ids(paths):
    return [p.stem for p in paths]


def test_there_are_notebooks():
    assert {"00_quickstart", "10_swap_volume", "15_exact_match"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} have outputs or execution counts; clear them before "
        "committing"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernel must be python3"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_has_a_parameters_cell_with_out_dir(path):
    nb = nbformat.read(path, as_version=4)
    cell = parameters_cell(nb)
    assert cell is not None and cell.cell_type == "code", (
        f"{path.name}: no code cell tagged 'parameters'"
    )
    assert {"quick", "out_dir"} <= parameter_names(path)
    assert nb.cells[0].cell_type == "markdown", (
        f"{path.name}: the first cell should say what the paper claims"
    )


def _experiment(path: Path) -> dict:
    """The experiment YAML whose ``notebook`` is ``path`` (quick mode only if none)."""
    import yaml

    for experiment in sorted((ROOT / "experiments").glob("*.yaml")):
        data = yaml.safe_load(experiment.read_text())
        if (ROOT / data.get("notebook", "")).resolve() == path.resolve():
            return data
    return {"quick": {"quick": True}}


def smoke_parameters(path: Path) -> dict:
    """The parameters a test runs ``path`` with: its experiment's quick mode, made
    smaller where that takes more than a few seconds (lessons: test_lessons.SMALL)."""
    from test_lessons import SMALL

    small = SMALL if path.parent.name == "lessons" else SMOKE
    return {**_experiment(path)["quick"], **small.get(path.stem, {})}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow)
        if p.stem in SLOW
        else pytest.param(p, marks=pytest.mark.heavy)
        if p.stem in HEAVY
        else p
        for p in NOTEBOOKS
    ],
    ids=_ids(NOTEBOOKS),
)
def test_runs_with_smoke_parameters(path, executed_notebook):
    pytest.importorskip("papermill")
    experiment = _experiment(path)
    run = executed_notebook(path)
    out = run.out
    results = json.loads((out / "results.json").read_text())
    assert results, "results.json is empty"
    if "summary" in experiment:  # the field the experiment calls our number
        value = results
        for key in experiment["summary"].split("."):
            value = value.get(key) if isinstance(value, dict) else None
        assert value is not None, (
            f"results.json has no {experiment['summary']!r} (the experiment's summary)"
        )
    assert list(out.glob("*.svg")) and list(out.glob("*.png")), (
        f"no figures in {sorted(out.iterdir())}"
    )
    if path.stem in SMOKE:  # ours: the conventional main figure and data
        assert (
            (out / "figure.svg").exists()
            and (out / "figure.png").exists()
            and (out / "data.csv").exists()
        )
        executed = nbformat.read(run.notebook, as_version=4)
        printed = "".join(
            o.get("text", "") for o in executed.cells[-1].outputs if o.output_type == "stream"
        )
        assert printed.strip(), "the last cell should print what this run measured"
