"""The teaching notebooks in ``notebooks/lessons/``: each runs through papermill
with small parameters and writes its outputs, the real-data lesson's engine and
plain-loop losses are bitwise equal, every lesson has its experiment YAML, and
the functions the lessons call (``harmony.workbench.lessons``) say what they claim."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml
from test_notebooks import parameter_names, parameters_cell

import harmony
from harmony.policies import names
from harmony.workbench import lessons as L
from harmony.workbench.experiments import ABLATION, BASELINE

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks" / "lessons").glob("*.ipynb"))

#: parameters smaller than the quick defaults, for a fast run of each lesson
SMALL: dict[str, dict] = {
    "01_swapping": {"minibatch": 8, "links": ["paper", "1GB/s"]},
    "02_grouping": {"minibatch": 16, "microbatch_counts": [2, 4, 16], "example_minibatch": 4},
    "03_scheduling": {"minibatch": 8, "prefetch_depths": [1, 2], "links": ["paper", "1GB/s"]},
    "04_many_gpus": {"minibatch": 16, "gpu_counts": [1, 2, 4], "timeline_gpus": 2},
    "05_exactness": {"steps": 4, "minibatch": 8, "variant_steps": 2},
}


def _experiments() -> dict[Path, dict]:
    """The experiment YAMLs whose notebook is a lesson, by notebook path."""
    found = {}
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        notebook = (ROOT / data["notebook"]).resolve()
        if notebook.parent == (ROOT / "notebooks" / "lessons").resolve():
            found[notebook] = {**data, "name": path.stem}
    return found


EXPERIMENTS = _experiments()


def _ids(paths):
    return [p.stem for p in paths]


def test_there_are_five_lessons_each_with_small_parameters():
    assert [p.stem for p in LESSONS] == sorted(SMALL)


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_every_lesson_has_an_experiment(path):
    experiment = EXPERIMENTS.get(path.resolve())
    assert experiment is not None, f"no experiments/lessons_*.yaml names {path.name}"
    assert experiment["name"].startswith("lessons_")
    params = parameter_names(path)
    for mode in ("quick", "full"):
        assert set(experiment[mode]) <= params, f"{experiment['name']} {mode}: not parameters"
    assert set(SMALL[path.stem]) <= params


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_is_committed_clean_and_complete(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# Lesson")
    cell = parameters_cell(nb)
    assert cell is not None and {"quick", "out_dir"} <= parameter_names(path)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Try this" in text and "L.try_this(" in "\n".join(c.source for c in nb.cells)
    assert "## Question" in text and "<details>" in text and "</details>" in text
    # a markdown cell between every two code cells (the explanation of what was seen)
    kinds = [c.cell_type for c in nb.cells if c is not cell]
    runs = "".join("c" if k == "code" else "m" for k in kinds)
    assert "ccc" not in runs, f"{path.name}: three code cells in a row without a word"


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_runs_with_small_parameters(path, executed_notebook):
    pytest.importorskip("papermill")
    experiment = EXPERIMENTS[path.resolve()]
    run = executed_notebook(path)  # with its quick parameters and SMALL's
    out, executed = run.out, run.notebook
    results = json.loads((out / "results.json").read_text())
    value = results
    for key in experiment["summary"].split("."):
        value = value.get(key) if isinstance(value, dict) else None
    assert value is not None, f"results.json has no {experiment['summary']!r}"
    for name in ("figure.svg", "figure.png", "data.csv"):
        assert (out / name).exists(), f"{path.name} wrote no {name}"
    nb = nbformat.read(executed, as_version=4)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    printed = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    assert printed.strip(), "the last code cell should print what this run found"
    if path.stem == "05_exactness":  # the real-data lesson: the engine is the plain loop
        assert results["losses_bitwise_equal"] is True and results["bitwise_equal"] is True
        assert results["max_abs_loss_diff"] == 0.0
        losses = results["losses"]
        assert len(losses) == SMALL[path.stem]["steps"]
        assert all(r["engine"] == r["reference"] for r in losses)
        assert results["corpus"]["name"] == "pydoc_data.topics"
    if path.stem == "01_swapping":
        assert results["closed_form_agrees"] and results["simulator_agrees"]
        assert results["engine_agrees"] is True
        # counted in passes, exactly M; in bytes about M (one-layer packs weigh a little more)
        assert results["passes_ratio"] == pytest.approx(results["microbatches"])
        assert results["w_in_ratio"] == pytest.approx(results["microbatches"], rel=0.05)


# ---- the functions behind the lessons -------------------------------------------------------
def test_the_policies_the_lessons_name_exist():
    assert {L.PIPELINE, L.DATA_PARALLEL} <= set(names(role="harmony"))
    assert BASELINE in names(role="system") and ABLATION in names(role="ablation")


@pytest.mark.parametrize("policy", [L.PIPELINE, BASELINE, ABLATION])
def test_closed_form_agrees_with_the_library_and_counts_passes(policy):
    spec = harmony.model_spec("bert-large")
    hw = harmony.preset("paper-4x1080ti")
    plan = L.lesson_plan(policy, spec, hw, 1, 16, 4, 7)
    form = L.closed_form(spec, plan)
    assert form["agrees"].all()
    passes = L.weight_passes(plan)
    assert passes == (1 if policy == L.PIPELINE else 4)
    assert form.loc[form["kind"] == "W_IN", "formula"].iloc[0].startswith(f"{passes} x")
    assert L.passes_counted(spec, plan, harmony.simulate(spec, hw, plan)) == pytest.approx(passes)


def test_the_lessons_baseline_is_per_layer_swapping_with_the_state_on_the_gpu():
    spec = harmony.model_spec("bert-large")
    hw = harmony.preset("paper-4x1080ti")
    plan = L.lesson_plan(BASELINE, spec, hw, 1, 16, 4, 7)
    assert all(b - a == 1 for a, b in plan.bwd_packs[:-1])  # one layer per pack
    assert plan.option("gpu_gradients") and plan.option("gpu_optimizer")
    form = L.closed_form(spec, plan).set_index("kind")
    grads = spec.grad_bytes()
    assert form.loc["G_IN", "GB"] == pytest.approx(3 * grads / 1e9)  # M - 1 accumulators back
    assert form.loc["OPT_IN", "GB"] == pytest.approx(
        (2 * grads + spec.optimizer_state_bytes()) / 1e9
    )
    assert form["agrees"].all()


def test_grouping_keeps_weight_bytes_flat_and_per_microbatch_swapping_does_not():
    spec = harmony.model_spec("bert-large")
    hw = harmony.preset("paper-4x1080ti")
    df = L.grouping_sweep(spec, hw, 16, [2, 4, 8], 7)
    harmony_w = df[df["policy"] == L.PIPELINE]["w_in_gb"]
    base_w = df[df["policy"] == L.policy_label(ABLATION)].set_index("microbatches")["w_in_gb"]
    assert harmony_w.nunique() == 1
    assert base_w[8] == pytest.approx(4 * base_w[2])


def test_pack_story_reads_one_backward_pack_in_order():
    spec = harmony.model_spec("bert-large")
    hw = harmony.preset("paper-4x1080ti")
    plan = harmony.Plan.uniform(L.PIPELINE, 1, 8, 4, len(spec), 7)
    story = L.pack_story(harmony.simulate(spec, hw, plan), plan, 1)
    kinds = list(story["kind"])
    assert kinds[0] == "W_IN" and kinds[-2:] == ["G_OUT", "UPD"]
    assert kinds.count("W_IN") == 1 and kinds.count("REC") == kinds.count("BWD") == 2
    assert kinds.count("STASH_IN") == 2
    assert story["start_ms"].is_monotonic_increasing


def test_update_overlap_and_idle_gaps_add_up():
    spec = harmony.model_spec("bert-large")
    hw = harmony.preset("paper-4x1080ti")
    plan = harmony.Plan.uniform(L.PIPELINE, 1, 8, 4, len(spec), 7)
    trace = harmony.simulate(spec, hw, plan)
    o = L.update_overlap(trace)
    assert 0 < o["overlapped_s"] <= o["update_s"]
    assert o["tail_s"] == pytest.approx(o["iteration_s"] - o["last_gpu_task_s"])
    gaps = L.idle_gaps(trace, top=100)
    assert gaps["idle_ms"].sum() / 1e3 == pytest.approx(L.gpu_idle_s(trace), rel=1e-6)


def test_wirings_change_only_what_they_say():
    hw = harmony.preset("8x4090-pcie4")
    preset, peer, own = L.wirings(hw).values()
    assert preset == hw and hw.p2p is None
    assert peer.p2p == hw.h2d and peer.gpus_per_switch == hw.gpus_per_switch
    assert own.p2p == hw.h2d and own.gpus_per_switch == 1


def test_corpus_is_python_text_and_its_batches_are_next_characters():
    corpus = L.load_corpus()
    assert len(corpus.text) > 100_000 and corpus.vocab == len(set(corpus.text))
    assert corpus.decode(corpus.encode("def f(x):")) == "def f(x):"
    ((x, y),) = corpus.batches(1, 4, 16, seed=3)
    assert x.shape == y.shape == (4, 16)
    assert (x[:, 1:] == y[:, :-1]).all()
    ((x2, _),) = corpus.batches(1, 4, 16, seed=3)
    assert (x == x2).all()


def test_dropout_masks_are_redrawn_only_for_the_same_microbatch():
    masks = L.dropout_masks(p=0.2)
    assert list(masks["same_mask_as_forward"]) == [True, False, False, False, False]
    assert masks["zeros"].between(0.15, 0.25).all()


def test_try_this_shows_its_first_result_at_once_readable_and_labelled_in_full():
    import ipywidgets as w

    calls = []

    def third(layers_per_pack):
        calls.append(layers_per_pack)
        return pd.DataFrame(
            {"plan": ["a"], "iteration_s": [1 / 3], "link_bound_below_GBps": [2.0]}
        )

    slider = w.IntSlider(value=3, min=1, max=8, description="per pack (H)")
    box = L.try_this(third, {"layers_per_pack": slider})
    out = box.children[2]
    assert calls == [3] and len(out.outputs) == 1  # no click needed
    html = out.outputs[0]["data"]["text/html"]
    assert ">0.333<" in html and "0.3333" not in html  # meaningful digits
    assert "link bound below GBps" in html and "overflow-x: auto" in html  # wraps or scrolls
    assert slider.style.description_width == "initial"  # "per pack (H)", not "per pack (…"
    slider.value = 4
    assert calls == [3, 4] and len(out.outputs) == 1  # replaced, not appended
