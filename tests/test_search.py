"""The planner: ranking, memory feasibility, errors, and its packing helpers."""

from __future__ import annotations

import itertools
import re

import pytest
from conftest import simple_hardware, tiny_spec
from hypothesis import given, settings
from hypothesis import strategies as st

import harmony
from harmony import HarmonyError, OutOfMemoryError
from harmony.costs.reference import max_profiled
from harmony.planner.packing import (
    balanced_packs,
    bwd_pack_bytes,
    fwd_pack_bytes,
    greedy_packs,
    microbatch_sizes,
    split_for_staging,
)


# ---- GPT-2 XL on the paper's server -------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_xl_search():
    spec = harmony.model_spec("gpt2-xl")
    hw = harmony.preset("paper-4x1080ti")
    return spec, hw, harmony.search(spec, hw, 64)


@pytest.mark.heavy
def test_gpt2_xl_search_ranks_fitting_plans(gpt2_xl_search):
    spec, hw, df = gpt2_xl_search
    assert len(df) > 10
    assert list(df["rank"]) == list(range(1, len(df) + 1))
    assert df.iteration_s.is_monotonic_increasing
    assert (df.peak_memory_gb * 1e9 <= hw.gpu_memory).all()
    assert set(df.policy) == {"harmony-pp", "harmony-dp", "harmony-no-grouping"}
    assert len(set(df.plan)) == len(df)  # no plan simulated twice
    assert df.attrs["simulated"] == len(df) + df.attrs["rejected_memory"]
    assert df.attrs["model"] == "gpt2-xl" and df.attrs["minibatch"] == 64
    _, bcap = max_profiled(spec)
    assert (df.bwd_microbatch <= bcap).all()  # no extrapolation past the profiled sizes
    for plan in df.plan:
        assert plan.minibatch == 64 and plan.n_gpus == 4
        plan.validate(len(spec))
    # input-batch grouping: Harmony moves far fewer bytes than per-microbatch swapping
    best = {
        policy: g.iloc[0] for policy, g in df.groupby("policy")
    }  # df is sorted: first = fastest
    vm = best["harmony-no-grouping"].swap_gb
    assert best["harmony-pp"].swap_gb * 5 < vm
    assert best["harmony-dp"].swap_gb < vm
    # leanest vs leanest: the baseline's leanest plan swaps per microbatch of 8 (8 microbatches):
    # ~7x
    assert (
        df.swap_gb[df.policy == "harmony-pp"].min() * 5
        < df.swap_gb[df.policy == "harmony-no-grouping"].min()
    )


@pytest.mark.heavy
def test_gpt2_xl_best_plan_resimulates_to_its_row(gpt2_xl_search):
    spec, hw, df = gpt2_xl_search
    top = df.iloc[0]
    s = harmony.simulate(spec, hw, top.plan).summary
    assert s.iteration_s == pytest.approx(top.iteration_s, rel=1e-12)
    assert s.fits and max(s.peak_memory.values()) <= hw.gpu_memory
    assert s.swap_bytes / 1e9 == pytest.approx(top.swap_gb)
    assert s.iteration_s >= s.lower_bound_s


# ---- infeasible and bad requests ----------------------------------------------------------------
def _with_huge_layer(params: int):
    spec = tiny_spec(4)
    layers = list(spec.layers)
    layers[2] = harmony.LayerCost(
        "giant",
        param_numel=params,
        input_numel_per_sample=10,
        fwd_time=harmony.Curve.linear(1e-3),
        bwd_time=harmony.Curve.linear(3e-3),
    )
    return harmony.ModelSpec("huge", tuple(layers))


def test_layer_larger_than_gpu_raises_out_of_memory():
    spec = _with_huge_layer(2_000_000_000)  # 8 GB of weights + 8 GB of gradients
    hw = simple_hardware(2, memory=10 * 10**9)
    with pytest.raises(OutOfMemoryError) as err:
        harmony.search(spec, hw, 8, workers=1)
    msg = str(err.value)
    assert "layer 2 (giant)" in msg
    need = float(re.search(r"needs ([0-9.]+) GB", msg).group(1))
    assert need == pytest.approx(16.0, abs=0.01)
    assert "10 GB" in msg  # what one GPU has
    assert isinstance(err.value, HarmonyError)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(minibatch_size=0), r"minibatch size must be a positive integer, got 0"),
        (dict(minibatch_size=-4), r"minibatch size must be a positive integer, got -4"),
        (dict(minibatch_size=2.5), r"minibatch size must be a positive integer, got 2.5"),
        (
            dict(policies=["harmony-pp", "zero-infinity"]),
            (
                r"unknown policy 'zero-infinity'; known policies: "
                r"harmony-pp, harmony-dp, harmony-no-grouping"
            ),
        ),
        (dict(policies=["hydra"]), r"for hydra use harmony.planner.plan_for"),
        (dict(n_gpus=3), r"n_gpus=3 is outside 1..2 for hardware 'simple-2'"),
        (dict(n_gpus=[1, 0]), r"n_gpus=0 is outside 1..2"),
    ],
)
def test_search_bad_inputs(kwargs, message):
    args = dict(minibatch_size=8, workers=1)
    args.update(kwargs)
    with pytest.raises(HarmonyError, match=message):
        harmony.search(tiny_spec(4), simple_hardware(2), **args)


def test_search_finds_a_plan_when_one_layer_needs_most_of_the_gpu():
    spec = tiny_spec(4)
    need = max(bwd_pack_bytes(spec, i, i + 1, 1) for i in range(len(spec)))
    hw = simple_hardware(1, memory=int(1.9 * need))
    packs = tuple((i, i + 1) for i in range(4))
    feasible = harmony.Plan("harmony-pp", 1, 4, 1, 1, packs[:-1], packs, {"prefetch_packs": 1})
    assert harmony.simulate(spec, hw, feasible).summary.fits  # a plan exists
    df = harmony.search(spec, hw, 4, workers=1)
    assert len(df) > 0


def test_search_accepts_numpy_integer_minibatch():
    np = pytest.importorskip("numpy")
    df = harmony.search(tiny_spec(2), simple_hardware(1), np.int64(8), workers=1)
    assert len(df) > 0


# ---- small searches -----------------------------------------------------------------------------
def test_search_over_gpu_counts_and_policies():
    spec = tiny_spec(6)
    hw = simple_hardware(2, memory=60_000_000)
    df = harmony.search(
        spec, hw, 8, policies=["harmony-pp", "harmony-no-grouping"], n_gpus=[1, 2], workers=1
    )
    assert set(df.policy) == {"harmony-pp", "harmony-no-grouping"}
    assert set(df.n_gpus) == {1, 2}
    assert df.iteration_s.is_monotonic_increasing
    for row in df.itertuples():
        assert row.plan.n_gpus == row.n_gpus and row.plan.policy == row.policy
        s = harmony.simulate(spec, hw, row.plan).summary
        assert s.fits and s.iteration_s == pytest.approx(row.iteration_s)
        if row.policy == "harmony-no-grouping":
            assert row.plan.fwd_microbatch == row.plan.bwd_microbatch
    assert {
        "plan",
        "iteration_s",
        "samples_per_s",
        "peak_memory_gb",
        "swap_gb",
        "p2p_gb",
        "lower_bound_s",
        "limited_by",
        "stage",
    } <= set(df.columns)


def test_search_rejects_plans_over_capacity_by_simulation():
    # memory tight enough that some candidates the packers propose do not fit once simulated
    spec = tiny_spec(6)
    need = max(bwd_pack_bytes(spec, i, i + 1, 1) for i in range(len(spec)))
    hw = simple_hardware(1, memory=int(3.5 * need))
    df = harmony.search(spec, hw, 8, workers=1)
    assert df.attrs["rejected_memory"] > 0
    assert (df.peak_memory_gb * 1e9 <= hw.gpu_memory).all()


# ---- helpers ------------------------------------------------------------------------------------
def test_microbatch_sizes():
    assert microbatch_sizes(12, None) == [1, 2, 4, 8, 12]
    assert microbatch_sizes(64, 9) == [1, 2, 4, 8, 9]
    assert microbatch_sizes(1, None) == [1]


def _best_max_sum(costs, k):
    n = len(costs)
    best = sum(costs)
    for parts in range(1, min(k, n) + 1):
        for cuts in itertools.combinations(range(1, n), parts - 1):
            bounds = (0, *cuts, n)
            best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), st.integers(1, 6), st.integers(0, 5)
)
def test_balanced_packs_minimise_the_largest_pack(costs, k, offset):
    packs = balanced_packs(costs, k, offset)
    assert 1 <= len(packs) <= k
    assert packs[0][0] == offset and packs[-1][1] == offset + len(costs)
    assert all(b > a for a, b in packs) and all(p[1] == q[0] for p, q in zip(packs, packs[1:]))
    worst = max(sum(costs[a - offset : b - offset]) for a, b in packs)
    assert worst <= _best_max_sum(costs, k) * (1 + 1e-9) + 1e-9


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 10).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(1, 8), st.floats(0.05, 1.0), st.booleans())
    )
)
def test_greedy_packs_respect_the_budget_and_cover(args):
    n, u, frac, backward = args
    spec = tiny_spec(n)
    size = bwd_pack_bytes if backward else fwd_pack_bytes
    total = size(spec, 0, n, u)
    budget = frac * total
    packs = greedy_packs(spec, 0, n, u, budget, backward)
    single = max(size(spec, i, i + 1, u) for i in range(n))
    if single > budget:
        assert packs is None
        return
    assert packs[0][0] == 0 and packs[-1][1] == n
    assert all(p[1] == q[0] for p, q in zip(packs, packs[1:]))
    assert all(size(spec, a, b, u) <= budget for a, b in packs)
    # greedy: no pack could take its neighbour's first (or last) layer
    for (a, b), (c, d) in zip(packs, packs[1:]):
        if backward:
            assert size(spec, b - 1, d, u) > budget  # fills from the last layer
        else:
            assert size(spec, a, b + 1, u) > budget


def test_equal_microbatches_only_when_the_model_needs_them():
    """A model with dropout or BatchNorm trains exactly only with one microbatch
    size: the search then proposes nothing else (what plan='auto' asks for)."""
    spec, hw = harmony.model_spec("bert-large"), harmony.preset("paper-4x1080ti")
    free = harmony.search(spec, hw, 32, policies=["harmony-pp"], n_gpus=1, workers=1)
    assert (free.fwd_microbatch != free.bwd_microbatch).any()
    tied = harmony.search(
        spec, hw, 32, policies=["harmony-pp"], n_gpus=1, workers=1, equal_microbatches=True
    )
    assert (tied.fwd_microbatch == tied.bwd_microbatch).all() and len(tied) > 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=8),  # pack lengths
    st.integers(0, 200),  # host memory beside the gradients, MB
    st.booleans(),  # the policy holds gradients in slots where host memory is short
)
def test_split_for_staging_cuts_packs_to_the_staging_share(lengths, host_mb, window):
    from harmony.costs.placement import GRADIENT_SLOTS, STAGED_PACKS
    from harmony.policies.state import host_state

    spec = tiny_spec(sum(lengths))  # 1e6 parameters a layer: 12 MB of weights + AdamW
    cuts = list(itertools.accumulate(lengths, initial=0))
    packs = tuple(zip(cuts, cuts[1:]))
    grads = host_state(spec, range(len(spec))).gradients
    host = grads + host_mb * 10**6
    out = split_for_staging(spec, packs, host, window)
    # the same layers, in order, cut only inside the given packs
    assert out[0][0] == 0 and out[-1][1] == len(spec)
    assert all(a < b for a, b in out) and all(x[1] == y[0] for x, y in zip(out, out[1:]))
    assert {a for a, _ in packs} <= {a for a, _ in out}

    def host_use(a: int, b: int) -> int:
        state = host_state(spec, range(a, b))
        gradients = GRADIENT_SLOTS * state.gradients if window else grads
        return STAGED_PACKS * (state.weights + state.optimizer) + gradients

    for a, b in out:
        assert host_use(a, b) <= host or b - a == 1
        # greedy: one more layer would not have fitted (or the given pack ended)
        if b < len(spec) and b not in {a for a, _ in packs}:
            assert host_use(a, b + 1) > host
