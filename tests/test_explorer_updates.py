"""What one change of the pack explorer costs: its live chart is altair's chart
built as a dict (the same spec), and a change simulates only what it changed,
each plan once (counted calls, not seconds)."""

import json
import math
import re
import time

import pandas as pd
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("altair")

from harmony.planner import systems  # noqa: E402
from harmony.workbench import play, row_pool  # noqa: E402
from harmony.workbench.live_spec import exploration_spec, records  # noqa: E402
from harmony.workbench.widgets import CLAIM_DOES_NOT_APPLY, PackExplorer  # noqa: E402

#: BERT-Large on one GPU (fast): lanes enough for the lane menu or not, a plan that runs
#: out of memory (a trace and a problem), state on disk (the disk's lanes)
SETTINGS = {
    "one GPU": {},
    "out of memory": {"pack_size": 12},
    "no lane menu": {"pack_size": 26, "fwd_microbatch": 8, "bwd_microbatch": 8},
    "state on disk": {"disk": "nvme", "host_memory": "45%"},
}


def _inlined(spec, datasets):
    """``spec`` with each named dataset put where it is used."""
    if isinstance(spec, dict):
        if set(spec) == {"name"} and spec["name"] in datasets:
            return {"values": datasets[spec["name"]]}
        return {k: _inlined(v, datasets) for k, v in spec.items() if k != "datasets"}
    if isinstance(spec, list):
        return [_inlined(v, datasets) for v in spec]
    return spec


def _named_in_order(spec) -> dict:
    """``spec`` with its data inlined and the names of its views and parameters
    (altair's are hashes) numbered in the order they appear."""
    text = json.dumps(_inlined(spec, spec.get("datasets", {})), sort_keys=True)
    seen: dict[str, str] = {}
    # altair's names (param_<hash>, view_<hash>_<i>) and the live spec's
    generated = r'"(param_[0-9a-f]+|view_[0-9a-f]+_\d+|lanes_shown|zoom|timeline_view)"'
    text = re.sub(generated, lambda m: f'"name {seen.setdefault(m[1], str(len(seen)))}"', text)
    # the same names inside expressions (the lane menu's filter)
    for name, number in seen.items():
        text = re.sub(rf"\b{name}\b", f"name {number}", text)
    return json.loads(text)


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_live_chart_is_the_altair_charts_spec(setting):
    ex = PackExplorer(**{**CLAIM_DOES_NOT_APPLY, **SETTINGS[setting]})
    r = ex.compute()
    assert r.trace is not None
    live = exploration_spec(r)
    assert _named_in_order(live) == _named_in_order(ex.chart(r).to_dict())  # validated
    if setting == "no lane menu":  # the case is what it says
        assert [p["name"] for p in live["params"]] == ["zoom"]
    if setting == "out of memory":
        assert "runs out of memory" in r.problem


def test_rows_are_written_as_altair_writes_them():
    import pandas as pd
    from altair.utils.data import to_values

    df = pd.DataFrame(
        {
            "x": [1.5, float("nan"), float("inf")],
            "n": [1, 2, 3],
            "ok": [True, False, True],
            "note": ["a", None, float("nan")],
        }
    )
    assert records(df) == to_values(df)["values"]
    assert records(df)[1] == {"x": None, "n": 2, "ok": False, "note": None}


@pytest.fixture
def counted(monkeypatch):
    """Fresh caches, every row simulated in this process, and the plans each
    simulation path played, counted."""
    for kept in (play.TRACES, play.OWN_PLANS, play.PICKED, play.PLAYED):
        kept.clear()
    row_pool._AHEAD.clear()
    systems.chooser_summary.cache_clear()
    monkeypatch.setattr(row_pool, "MAX_WORKERS", 1)
    calls = {"traces": [], "chooser": []}

    def simulate(spec, hw, plan, _simulate=play.simulate):
        calls["traces"].append(plan)
        return _simulate(spec, hw, plan)

    def simulate_graph(graph, _simulate=systems.simulate_graph):
        calls["chooser"].append(graph.info.get("policy"))
        return _simulate(graph)

    monkeypatch.setattr(play, "simulate", simulate)
    monkeypatch.setattr(systems, "simulate_graph", simulate_graph)
    return calls


def _own_plans(r):
    rows = r.comparison[r.comparison.planned_by == "its own rule"]
    return [p for p in rows.policy if not rows.set_index("policy").loc[p, "chosen"]]


def test_a_baselines_pick_is_simulated_once_by_its_chooser(counted):
    ex = PackExplorer(**CLAIM_DOES_NOT_APPLY)
    r = ex.compute()
    own = _own_plans(r)
    assert own  # the baselines on their own plans have rows
    # their rows take the chooser's numbers: none of their picks is played again
    assert not [p for p in counted["traces"] if p.policy in own]
    # every other plan is played once
    assert len(counted["traces"]) == len(set(counted["traces"]))
    # a pick's numbers were kept when its chooser simulated it
    rows = r.comparison.set_index("policy")
    picked = [p for p in own if not math.isnan(rows.loc[p, "bwd_microbatch"])]
    assert picked and systems.chooser_summary.cache_info().hits >= len(picked)


def test_a_change_simulates_only_what_depends_on_it(counted):
    ex = PackExplorer(**CLAIM_DOES_NOT_APPLY)
    ex.compute()
    rows = ex.result.comparison
    on_the_controls = set(rows.policy[rows.planned_by == "the controls"])
    counted["traces"].clear()
    counted["chooser"].clear()
    ex.pack_size.value = 3
    ex.compute()
    # the packs change the plans on the controls only: each played once, no chooser runs
    assert {p.policy for p in counted["traces"]} <= on_the_controls
    assert len(counted["traces"]) == len(set(counted["traces"])) > 0
    assert counted["chooser"] == []
    # another policy chosen, or the same setting again: every plan was played already
    counted["traces"].clear()
    ex.policy.value = "harmony-dp"
    ex.compute()
    ex.pack_size.value = 2
    ex.compute()
    assert counted["traces"] == [] and counted["chooser"] == []


def _fresh(monkeypatch, workers: int) -> None:
    for kept in (play.TRACES, play.OWN_PLANS, play.PICKED, play.PLAYED):
        kept.clear()
    row_pool._AHEAD.clear()  # an earlier test's rows ahead: not kept here
    systems.chooser_summary.cache_clear()
    monkeypatch.setattr(row_pool, "MAX_WORKERS", workers)
    monkeypatch.setattr(row_pool, "cores", lambda: workers)


SIDE_BY_SIDE = [
    CLAIM_DOES_NOT_APPLY,
    {"model": "gpt2-tiny", "minibatch": 8, "host_memory": "45%", "disk": "nvme"},
]


@pytest.mark.skipif("fork" not in row_pool.mp.get_all_start_methods(), reason="no fork here")
@pytest.mark.parametrize("setting", SIDE_BY_SIDE, ids=["claim", "state on disk"])
def test_rows_from_the_workers_are_the_rows_simulated_here(monkeypatch, setting):
    _fresh(monkeypatch, 1)
    here = PackExplorer(**setting).compute()
    _fresh(monkeypatch, 2)
    ex = PackExplorer(**setting)
    side_by_side = ex.compute()
    # no chooser simulated a candidate here: they all ran in the workers
    assert systems.chooser_summary.cache_info().misses == 0
    pd.testing.assert_frame_equal(side_by_side.comparison, here.comparison)
    assert side_by_side.headline == here.headline
    # choosing another row draws its plan: played here, as it was in the workers
    ex.policy.value = "harmony-dp"
    assert ex.compute().comparison.equals(
        side_by_side.comparison.assign(chosen=side_by_side.comparison.policy == "harmony-dp")
        .set_index("policy")
        .loc[ex.result.comparison.policy]
        .reset_index()
    )


@pytest.mark.skipif("fork" not in row_pool.mp.get_all_start_methods(), reason="no fork here")
def test_workers_that_died_leave_their_rows_to_this_process(monkeypatch):
    _fresh(monkeypatch, 2)
    ex = PackExplorer(**CLAIM_DOES_NOT_APPLY)
    ex.compute()
    for process in list(row_pool._EXECUTOR._processes.values()):
        process.kill()
        process.join()
    ex.pack_size.value = 3
    r = ex.compute()
    assert r.problem is None and r.comparison.iteration_s.notna().sum() >= 4
    _fresh(monkeypatch, 1)
    assert (
        PackExplorer(**{**CLAIM_DOES_NOT_APPLY, "pack_size": 3})
        .compute()
        .comparison.equals(r.comparison)
    )


def _serial(monkeypatch, setting: dict) -> pd.DataFrame:
    """The comparison of ``setting`` simulated in this process, from empty caches."""
    _fresh(monkeypatch, 1)
    return PackExplorer(**setting).compute().comparison


def _sends(monkeypatch) -> list:
    """The rows sent to the workers from now on, recorded as they are sent."""
    sent, job = [], row_pool._job
    monkeypatch.setattr(row_pool, "_job", lambda key: sent.append(key) or job(key))
    return sent


@pytest.mark.skipif("fork" not in row_pool.mp.get_all_start_methods(), reason="no fork here")
def test_the_rows_one_step_away_are_simulated_ahead_and_a_change_takes_them(monkeypatch):
    _fresh(monkeypatch, 2)
    monkeypatch.setattr(row_pool, "AHEAD", True)
    ex = PackExplorer(**CLAIM_DOES_NOT_APPLY)
    ex.widget()  # shown: the plans one step from the controls go to the workers
    ahead = dict(row_pool._AHEAD)
    assert {what for what, _ in ahead} == {"play"}  # the choosers' rows do not change
    steps = ex.steps()  # a layer more per pack, each microbatch size halved and doubled
    assert {"pack_size": ex.pack_size.value + 1} in steps and len(steps) >= 3
    assert len({args[3] for _, args in ahead}) >= len(steps)  # a plan per step and policy
    assert ex.policy.value not in {args[3].policy for _, args in ahead}  # played here
    for future in ahead.values():
        future.result()
    monkeypatch.setattr(row_pool, "AHEAD", False)
    sent = _sends(monkeypatch)
    ex.pack_size.value += 1
    assert sent == []  # every row of the change was simulated ahead
    assert not row_pool._AHEAD  # and kept
    stepped = ex.result.comparison
    pd.testing.assert_frame_equal(
        stepped, _serial(monkeypatch, {**CLAIM_DOES_NOT_APPLY, "pack_size": ex.pack_size.value})
    )


@pytest.mark.skipif("fork" not in row_pool.mp.get_all_start_methods(), reason="no fork here")
def test_a_change_elsewhere_drops_the_rows_ahead_no_worker_started(monkeypatch):
    _fresh(monkeypatch, 2)
    monkeypatch.setattr(row_pool, "AHEAD", True)
    # the worker ahead kept busy: the rows sent ahead wait, however fast it is
    busy = row_pool._ahead_pool().submit(time.sleep, 5)
    ex = PackExplorer(**CLAIM_DOES_NOT_APPLY)
    ex.widget()
    waiting = [f for f in row_pool._AHEAD.values() if not (f.running() or f.done())]
    assert len(waiting) >= 3
    monkeypatch.setattr(row_pool, "AHEAD", False)
    sent = _sends(monkeypatch)
    ex.model.value = "gpt2-tiny"
    assert sent  # the new model's rows, sent with none of the old ones queued before them
    # none waits any more: all dropped (one may have gone to the worker's queue meanwhile)
    assert sum(f.cancelled() for f in waiting) >= len(waiting) - 1
    assert all(f.running() or f.done() for f in row_pool._AHEAD.values())
    r = ex.result.comparison
    busy.cancel()
    row_pool._forget_pool()  # the tests after this one get workers that are not asleep
    setting = {**CLAIM_DOES_NOT_APPLY, "model": "gpt2-tiny"}
    pd.testing.assert_frame_equal(r, _serial(monkeypatch, setting))


@pytest.mark.skipif("fork" not in row_pool.mp.get_all_start_methods(), reason="no fork here")
@pytest.mark.parametrize(
    "cores, setting, on", [(2, None, False), (4, None, True), (2, True, True)]
)
def test_rows_go_ahead_with_cores_to_spare_or_when_asked(monkeypatch, cores, setting, on):
    _fresh(monkeypatch, cores)
    monkeypatch.setattr(row_pool, "AHEAD", setting)
    assert row_pool.ahead_on() is on
    _fresh(monkeypatch, 1)  # one core: no workers at all, whatever was asked
    assert row_pool.ahead_on() is False
