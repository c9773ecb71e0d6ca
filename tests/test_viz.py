"""Charts are built from traces without a browser and stay under Altair's row limit."""

import harmony
from harmony.plan import Plan, uniform_packs
from harmony.workbench.charts import MAX_ROWS, coalesce, memory_chart, timeline_chart


def _trace(minibatch=64, u=1):
    spec = harmony.model_spec("bert-large")
    packs = uniform_packs(0, len(spec), 2)
    plan = Plan("virtual-memory", 4, minibatch, u, u, packs[:-1], packs)
    return harmony.simulate(spec, harmony.preset("paper-4x1080ti"), plan)


def test_large_traces_are_aggregated_not_truncated():
    trace = _trace()
    assert len(trace.timeline) > MAX_ROWS
    small = coalesce(trace.timeline)
    assert len(small) <= MAX_ROWS
    assert small.tasks.sum() == len(trace.timeline)  # every task is behind some bar
    assert abs(small.bytes.sum() - trace.timeline.bytes.sum()) < 1e-6 * trace.timeline.bytes.sum()
    spec = timeline_chart(trace).to_dict()
    rows = next(iter(spec["datasets"].values()))
    assert len(rows) <= MAX_ROWS
    assert {r["lane"] for r in rows} == set(trace.timeline.lane)


def test_small_traces_keep_one_bar_per_task():
    trace = _trace(minibatch=4, u=4)
    assert len(coalesce(trace.timeline)) == len(trace.timeline)
    assert memory_chart(trace).to_dict()["layer"]
