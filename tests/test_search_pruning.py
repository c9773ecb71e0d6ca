"""The search's pruning: the compute lower bound it rests on, and that the pruned
search keeps the plans, times and order the full search ranks first."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import pytest
from conftest import scenarios, simple_hardware, tiny_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harmony
from harmony.graph import TRANSFER_KINDS, UPD
from harmony.policies import build_graph, compute_lower_bound

#: the searched policies that list their compute ops apart from their graphs
WITH_OPS = ("harmony-pp", "harmony-dp", "harmony-no-grouping")


def _busiest_lane_compute(graph) -> float:
    """The compute seconds of the busiest GPU compute lane of a built graph."""
    busy: dict[str, float] = defaultdict(float)
    for t in graph.tasks:
        if t.kind not in TRANSFER_KINDS and t.kind != UPD:
            busy[t.lane] += t.duration
    return max(busy.values(), default=0.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenarios(policies=WITH_OPS),
    st.sampled_from(["task", "pack"]),
    st.sampled_from([0.0, 1e-3, 0.04]),
)
def test_compute_lower_bound_is_the_busiest_gpus_compute_and_bounds_the_play(
    case, overhead_per, overhead
):
    spec, hw, plan = case
    hw = replace(hw, overhead_per=overhead_per, task_overhead_s=overhead)
    graph = build_graph(spec, hw, plan)
    bound = compute_lower_bound(spec, hw, plan)
    assert math.isclose(bound, _busiest_lane_compute(graph), rel_tol=1e-6, abs_tol=1e-9)
    assert bound <= harmony.simulate_graph(graph).summary.iteration_s


def test_compute_lower_bound_is_none_for_a_policy_without_ops():
    spec = tiny_spec(4)
    plan = harmony.policies.resident.plan_for(len(spec), 8, 4)
    assert compute_lower_bound(spec, simple_hardware(1), plan) is None


#: (model, hardware, minibatch, GPU counts, top_k): pipelines and data parallel, the
#: fixed cost per pack and per task, one to four GPUs
CASES = [
    ("gpt2-tiny", "paper-4x1080ti", 16, [1, 4], 2),
    ("bert-tiny", "paper-4x1080ti", 16, [2], 1),
    ("resnet-tiny", "paper-4x1080ti", 16, [1, 4], 3),
    ("vgg-tiny", "8x4090-pcie4", 16, [1, 2], 2),
    ("gpt2-medium", "paper-4x1080ti", 16, [4], 2),
]


@pytest.mark.parametrize("model, hardware, minibatch, n_gpus, top_k", CASES)
def test_pruned_search_ranks_its_plans_as_the_full_search(
    model, hardware, minibatch, n_gpus, top_k
):
    spec, hw = harmony.model_spec(model), harmony.preset(hardware)
    kwargs = dict(n_gpus=n_gpus, top_k=top_k, workers=1)
    full = harmony.search(spec, hw, minibatch, **kwargs)
    pruned = harmony.search(spec, hw, minibatch, prune=True, **kwargs)
    columns = [c for c in full.columns if c != "rank"]
    # the rows kept are the full search's, in its order, with the same values ...
    kept = full[full.plan.isin(set(pruned.plan))].reset_index(drop=True)
    assert kept[columns].equals(pruned[columns])
    # ... among them the fastest top_k of every policy and GPU count, so the top ranks
    for _, group in full.groupby(["policy", "n_gpus"]):
        assert set(group.plan.head(top_k)) <= set(pruned.plan)
    assert list(pruned.plan.head(top_k)) == list(full.plan.head(top_k))
    assert "pruned" not in full.attrs
    assert pruned.attrs["simulated"] + pruned.attrs["pruned"] == full.attrs["simulated"]
    assert len(full) - len(pruned) <= pruned.attrs["pruned"]


def test_pruning_skips_candidates_in_a_search_with_many():
    # not a property of every search (a small one may prune nothing), but this one must
    spec, hw = harmony.model_spec("gpt2-medium"), harmony.preset("paper-4x1080ti")
    df = harmony.search(spec, hw, 16, workers=1, prune=True)
    assert df.attrs["pruned"] > 0
