"""experiments/*.yaml match their notebooks, and the runner behind
``harmony reproduce`` skips what is up to date and survives a failing notebook."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from test_notebooks import NOTEBOOKS, ROOT, parameter_names

import harmony
from harmony.errors import HarmonyError
from harmony.workbench import experiments as E
from harmony.workbench import outcomes
from harmony.workbench import reproduce as rp

EXPERIMENTS = rp.load_experiments(ROOT / "experiments")


def test_every_notebook_has_an_experiment_and_back():
    notebooks = {p.resolve() for p in NOTEBOOKS}
    used = {e.notebook for e in EXPERIMENTS.values()}
    assert notebooks - used == set(), (
        f"notebooks without an experiment: {sorted(p.name for p in notebooks - used)}"
    )
    missing = {e.name: str(e.notebook) for e in EXPERIMENTS.values() if not e.notebook.exists()}
    assert not missing, f"experiments whose notebook does not exist: {missing}"


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_yaml_parameters_exist_in_the_notebook(name):
    exp = EXPERIMENTS[name]
    params = parameter_names(exp.notebook)
    for mode in ("quick", "full"):
        unknown = set(exp.params(mode == "full")) - params
        assert not unknown, (
            f"{name}.yaml {mode}: {sorted(unknown)} are not parameters of {exp.notebook.name}"
        )
    assert exp.claim and exp.paper and exp.summary
    assert exp.quick.get("quick") is True and exp.full.get("quick") is False


def test_select_by_name_or_prefix():
    assert [e.name for e in rp.select(EXPERIMENTS, ["10"])] == ["10_swap_volume"]
    assert [e.name for e in rp.select(EXPERIMENTS, ["15_exact_match", "00"])] == [
        "15_exact_match",
        "00_quickstart",
    ]
    assert len(rp.select(EXPERIMENTS, None)) == len(EXPERIMENTS)
    with pytest.raises(HarmonyError, match="not one of"):
        rp.select(EXPERIMENTS, ["99_nothing"])
    with pytest.raises(HarmonyError, match="matches several"):
        rp.select(EXPERIMENTS, ["1"])


GOOD = """
import json, pathlib
out = pathlib.Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "results.json").write_text(json.dumps({"answer": {"value": value * 2}}))
(out / "data.csv").write_text(f"value\\n{value}\\n")
(out / "extra.csv").write_text("x\\n1\\n")
(out / "figure.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
(out / "figure.png").write_bytes(b"png")
"""


def _notebook(path: Path, body: str) -> None:
    params = new_code_cell(
        "quick: bool = True  # smoke\nvalue: int = 1  # a number\nout_dir: str = 'out'  # where to"
    )
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[new_markdown_cell("# tiny"), params, new_code_cell(body)])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


def _project(tmp_path: Path, **bodies: str) -> Path:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "experiments").mkdir()
    for name, body in bodies.items():
        _notebook(tmp_path / "notebooks" / f"{name}.ipynb", body)
        (tmp_path / "experiments" / f"{name}.yaml").write_text(
            f"notebook: notebooks/{name}.ipynb\nclaim: the paper says 42\npaper: '42'\nsummary: "
            "answer.value\nquick: {quick: true, value: 21}\nfull: {quick: false, value: 50}\n"
        )
    return tmp_path / "experiments"


def _run(experiments: Path, out: Path, **kwargs):
    return rp.reproduce(
        kwargs.pop("names", None),
        kwargs.pop("full", False),
        out,
        experiments_dir=experiments,
        progress=False,
        **kwargs,
    )


def test_runner_runs_copies_skips_unchanged_and_reruns_when_forced_or_changed(
    tmp_path, monkeypatch, capsys
):
    pytest.importorskip("papermill")
    experiments = _project(tmp_path, a_tiny=GOOD)
    out = tmp_path / "figures"
    report = _run(experiments, out)
    (o,) = report.outcomes
    assert (o.status, o.ours, report.exit_code) == ("ok", "42", 0)
    run_dir = experiments / "runs" / "a_tiny"
    assert (run_dir / "a_tiny.ipynb").exists() and (run_dir / "results.json").exists()
    assert sorted(p.name for p in out.iterdir()) == [
        "a_tiny.csv",
        "a_tiny.png",
        "a_tiny.svg",
        "a_tiny_extra.csv",
        "summary.json",
        "summary.md",
    ]
    assert (out / "a_tiny.csv").read_text() == "value\n21\n"
    table = capsys.readouterr().out
    assert "a_tiny" in table and "42" in table and "ok" in table

    assert (
        _run(experiments, out).outcomes[0].status == "skipped"
    )  # same notebook, parameters, code
    assert _run(experiments, out, force=True).outcomes[0].status == "ok"
    assert _run(experiments, out, full=True).outcomes[0].ours == "100"  # other parameters
    monkeypatch.setattr(rp, "_package_hash", lambda: "changed harmony source")
    assert _run(experiments, out, full=True).outcomes[0].status == "ok"
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["name"], s["status"], s["mode"]) for s in summary] == [("a_tiny", "ok", "full")]
    monkeypatch.chdir(tmp_path)  # a summary names its runs from where it was made
    _run(experiments, out, force=True)
    (entry,) = json.loads((out / "summary.json").read_text())
    assert entry["run_dir"] == str(Path("experiments") / "runs" / "a_tiny")


def test_a_failing_notebook_is_reported_and_the_others_still_run(tmp_path):
    pytest.importorskip("papermill")
    experiments = _project(
        tmp_path,
        a_broken="print('before')\nraise RuntimeError('boom in the notebook')",
        b_fine=GOOD,
    )
    out = tmp_path / "figures"
    report = _run(experiments, out)
    status = {o.name: o.status for o in report.outcomes}
    assert status == {"a_broken": "failed", "b_fine": "ok"}
    assert report.failures == ["a_broken"] and report.exit_code == 1 and not report
    broken = next(o for o in report.outcomes if o.name == "a_broken")
    assert "boom in the notebook" in broken.error
    partial = experiments / "runs" / "a_broken" / "a_broken.ipynb"
    assert partial.exists(), "the partial output notebook is kept"
    assert "FAILED a_broken" in report.table()
    assert (out / "b_fine.svg").exists() and not list(out.glob("a_broken*"))
    # a failed run is never skipped
    assert _run(experiments, out, names=["a_broken"]).outcomes[0].status == "failed"
    assert "a_broken" in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    "ours, target, better, verdict",
    [
        ("7.6", 7.6, "higher", "reproduced"),
        ("9", 7.6, "higher", "reproduced"),
        ("6", 7.6, "higher", "reproduced"),
        ("4", 7.6, "higher", "partly"),
        ("1.1", 7.6, "higher", "not reproduced"),
        ("0", 0.0, "lower", "reproduced"),
        ("0.2", 0.0, "lower", "not reproduced"),
        ("1.31", 1.0, "near", "partly"),
        ("0.9", 1.0, "near", "reproduced"),
        ("n/a", 7.6, "higher", "-"),
        ("3", None, "higher", "-"),
    ],
)
def test_each_claim_gets_a_verdict_against_the_papers_number(ours, target, better, verdict):
    o = outcomes.Outcome(
        name="x",
        claim="",
        paper="",
        ours=ours,
        status="ok",
        seconds=0.0,
        mode="quick",
        target=target,
        better=better,
    )
    assert o.verdict == verdict


def test_a_gap_sentence_is_filled_from_the_runs_results():
    results = {"max": 4.321, "per": {"model": 2.0}, "none": None}
    text = outcomes.fill_gap("up to {max:.2f}x, {per.model:.1f}x, {none:.1f}, {missing}", results)
    assert text == "up to 4.32x, 2.0x, n/a, n/a"
    assert outcomes.fill_gap("no fields", results) == "no fields"


def test_further_claims_of_an_experiment_get_their_own_rows(tmp_path):
    pytest.importorskip("papermill")
    experiments = _project(tmp_path, a_tiny=GOOD)
    path = experiments / "a_tiny.yaml"
    path.write_text(
        path.read_text()
        + "target: 84\ngap: 'ours {answer.value:.0f}'\nclaims:\n"
        + "  - {label: half, claim: half of it, paper: '21', summary: answer.value, target: 21,"
        + " better: lower, gap: 'at {answer.value} it is over'}\n"
    )
    report = _run(experiments, tmp_path / "figures")
    main, half = report.outcomes
    assert (main.name, main.ours, main.verdict, main.gap) == ("a_tiny", "42", "partly", "ours 42")
    assert (half.name, half.ours, half.of, half.status) == ("a_tiny/half", "42", "a_tiny", "ok")
    assert half.verdict == "partly" and half.gap == "at 42 it is over"
    assert report.failures == [] and "with a_tiny" in report.table()
    summary = (tmp_path / "figures" / "summary.md").read_text()
    assert "a_tiny/half" in summary and "at 42 it is over" in summary


def _grid_row(system, role, samples_per_s, swap_gb, fits=True, microbatch=4):
    s = 1 / samples_per_s if samples_per_s else math.nan
    return {
        "model": "m",
        "minibatch": 16,
        "system": system,
        "role": role,
        "plan": f"{system} plan",
        "microbatch": microbatch,
        "fits": fits,
        "reason": "chosen" if fits else "does not fit",
        "samples_per_s": samples_per_s if fits else math.nan,
        "swap_gb": swap_gb if fits else math.nan,
        "iteration_s": s,
        "iteration_s_no_fixed": s / 2,
    }


def test_harmony_is_held_against_each_baseline_and_the_ablation_apart():
    grid = pd.DataFrame(
        [
            _grid_row("harmony", "harmony", 4.0, 10.0, microbatch=2),
            _grid_row("harmony (least swap)", "harmony", 3.0, 5.0),
            _grid_row("harmony-pp", "harmony", 3.0, 5.0),
            _grid_row("harmony-dp", "harmony", 4.0, 10.0),
            _grid_row(E.ABLATION, "ablation", 2.0, 20.0),
            _grid_row(E.BASELINE, "baseline", 1.0, 100.0, microbatch=8),
            _grid_row("gpipe-swap", "baseline", 1.0, 100.0, fits=False),
        ]
    )
    versus = E.versus_baselines(grid).set_index("baseline")
    assert {"microbatch", "fits", "reason"} <= set(versus.columns)
    base = versus.loc[E.BASELINE]
    assert (base.microbatch, base.harmony_microbatch) == (8, 2)
    assert (base.swap_ratio, base.swap_ratio_min, base.speedup) == (10.0, 20.0, 4.0)
    assert base["speedup_harmony-pp"] == 3.0 and base.speedup_no_fixed == pytest.approx(4.0)
    assert math.isnan(versus.loc["gpipe-swap", "speedup"])  # no plan: nothing to compare
    claims = E.grid_claims(versus.reset_index())
    assert claims["max_speedup"] == 4.0 and claims["max_swap_ratio_min"] == 20.0
    assert claims["ablation_max_speedup"] == 2.0  # the ablation never counts as a baseline


def test_each_rung_of_the_ladder_adds_one_technique():
    spec, hw = harmony.model_spec("bert-large"), harmony.preset("paper-4x1080ti")
    rungs = [plan for _, _, plan in E.ladder_plans(spec, hw, 16, workers=1)]
    assert len(rungs) == len(E.RUNGS)
    bottom, packs, prefetch, cpu, grouped, p2p, top = rungs
    assert bottom.policy == E.BASELINE and all(b - a == 1 for a, b in bottom.bwd_packs[:-1])
    assert bottom.option("prefetch_packs") == 1 and bottom.option("gpu_optimizer")
    assert (packs.bwd_packs, packs.bwd_microbatch) == (top.bwd_packs, top.bwd_microbatch)
    assert packs.option("prefetch_packs") == 1 and packs.option("gpu_gradients")
    assert prefetch == packs.with_options(prefetch_packs=2)
    assert cpu == prefetch.with_options(gpu_gradients=False, gpu_optimizer=False)
    assert (grouped.policy, grouped.option("overlap_recompute")) == ("harmony-dp", False)
    assert (p2p.policy, p2p.option("overlap_recompute")) == ("harmony-pp", False)
    assert top == p2p.with_options(overlap_recompute=True) and top.policy == "harmony-pp"
