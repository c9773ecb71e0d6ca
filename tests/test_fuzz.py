"""Random valid and invalid plans, specs and servers thrown at search, simulate
and the engine: valid ones never crash and never exceed memory; invalid ones
raise harmony's own errors, never an internal exception."""

from __future__ import annotations

import math

import torch
from conftest import hardwares, model_specs, plans
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_engine import ADAMW, B, batches, loss_fn, make_model

from harmony import (
    POLICIES,
    Curve,
    EmulatedDevice,
    Engine,
    Hardware,
    HarmonyError,
    LayerCost,
    ModelSpec,
    Plan,
    search,
    simulate,
)

ANY_NUMBER = st.one_of(
    st.integers(-5, 10**7),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.just("7"),
    st.booleans(),
)
SMALL_INT = st.one_of(st.integers(-2, 14), st.just(True), st.just(2.5), st.none())


def often(valid, anything):
    """Mostly valid values, sometimes anything: so that whole objects are often valid."""
    return st.integers(0, 3).flatmap(lambda i: anything if i == 0 else valid)


@st.composite
def raw_packs(draw, n: int = 9):
    """Pack tuples that are often wrong: gaps, overlaps, empty, reversed, out of range."""
    return tuple(
        draw(st.lists(st.tuples(st.integers(-1, n + 1), st.integers(-1, n + 1)), max_size=4))
    )


@st.composite
def raw_plans(draw, n: int = 9, minibatch: int = B):
    options = draw(
        st.one_of(
            st.just({}),
            st.dictionaries(
                st.sampled_from(["offload_activations", "prefetch_packs", "turbo"]),
                st.one_of(st.booleans(), st.integers(-1, 3), st.just("yes")),
                max_size=2,
            ),
        )
    )
    return dict(
        policy=draw(st.sampled_from([*POLICIES, "magic"])),
        n_gpus=draw(SMALL_INT),
        minibatch=draw(st.one_of(st.just(minibatch), SMALL_INT)),
        fwd_microbatch=draw(SMALL_INT),
        bwd_microbatch=draw(SMALL_INT),
        fwd_packs=draw(raw_packs(n)),
        bwd_packs=draw(raw_packs(n)),
        options=options,
    )


def make_plan(fields: dict) -> Plan:
    """A Plan from raw fields (its constructor may refuse them: that is part of the test)."""
    return Plan(**fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=model_specs(max_layers=9),
    hw=hardwares(memory=st.integers(10**6, 10**10)),
    fields=raw_plans(),
)
def test_simulate_takes_any_plan_or_says_what_is_wrong(spec, hw, fields):
    try:
        trace = simulate(spec, hw, make_plan(fields))
    except HarmonyError:
        return
    s = trace.summary
    assert s.iteration_s >= 0 and math.isfinite(s.iteration_s)


@settings(max_examples=100, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {
            "name": st.just("l"),
            "param_numel": ANY_NUMBER,
            "buffer_numel": st.one_of(st.just(0), ANY_NUMBER),
            "input_numel_per_sample": ANY_NUMBER,
            "fwd_flops_per_sample": ANY_NUMBER,
            "update_time_s": st.one_of(st.none(), ANY_NUMBER),
            "fwd_time": st.one_of(
                st.none(), st.just("fast"), st.tuples(st.floats(-1, 1), st.floats(-1, 1))
            ),
        }
    )
)
def test_layer_costs_are_checked_when_made(fields):
    try:
        if isinstance(fields["fwd_time"], tuple):
            fields["fwd_time"] = Curve.linear(*fields["fwd_time"])
        layer = LayerCost(**fields)
    except HarmonyError:
        return
    spec = ModelSpec("one", (layer, layer))
    assert spec.weight_bytes() >= 0 and spec.fwd_time(0, 2, 4, 1e12) >= 0


@settings(max_examples=100, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {
            "n_gpus": often(st.integers(1, 4), SMALL_INT),
            "gpu_memory": often(st.integers(10**3, 10**7), ANY_NUMBER),
            "gpu_flops": often(st.just(1e12), ANY_NUMBER),
            "h2d": often(st.just(1e9), ANY_NUMBER),
            "d2h": st.just(1e9),
            "uplink": often(st.just(1e9), ANY_NUMBER),
            "gpus_per_switch": often(st.just(1), SMALL_INT),
            "p2p": st.one_of(st.none(), ANY_NUMBER),
            "cpu_update_bandwidth": st.just(1e9),
            "cpu_update_workers": often(st.just(2), SMALL_INT),
            "host_memory": st.just(10**12),
        }
    )
)
def test_hardware_is_checked_when_made_and_search_never_crashes(fields):
    try:
        hw = Hardware(name="random", **fields)
    except HarmonyError:
        return
    spec = ModelSpec(
        "two",
        (
            LayerCost("a", 1000, input_numel_per_sample=10.0),
            LayerCost("b", 1000, input_numel_per_sample=10.0),
        ),
    )
    try:
        found = search(spec, hw, 4, workers=1)
    except HarmonyError:
        event("search refused")
        return
    event("searched")
    assert (found["peak_memory_gb"] * 1e9 <= hw.gpu_memory * (1 + 1e-9)).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_engine_runs_valid_plans_within_memory_and_refuses_the_rest_unchanged(data):
    """Any plan, valid or not, on a small emulated GPU: the engine refuses it at
    set-up, or runs out of memory cleanly (weights untouched), or trains within
    the device's capacity."""
    valid = data.draw(st.booleans())
    fields = (
        data.draw(plans("harmony-pp", 9, 1, minibatch=st.just(B))).to_dict()
        if valid
        else data.draw(raw_plans())
    )
    memory = data.draw(st.sampled_from(["40KB", "120KB", "4MB"]))
    device = EmulatedDevice(memory=memory, h2d="2GB/s", d2h="2GB/s")
    model = make_model(dropout=0.0, batchnorm=False)
    before = [t.clone() for t in model.state_dict().values()]
    try:
        engine = Engine(
            model,
            ADAMW,
            loss_fn,
            device=device,
            minibatch_size=B,
            plan=make_plan(
                {
                    **fields,
                    "fwd_packs": tuple(map(tuple, fields["fwd_packs"])),
                    "bwd_packs": tuple(map(tuple, fields["bwd_packs"])),
                }
            ),
        )
        x, y = batches(1)[0]
        engine.step(x, y)
    except HarmonyError as err:
        event(f"refused: {type(err).__name__}")
        assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
        return
    event("trained")
    assert valid
    assert engine.trace.summary.peak_memory["gpu0"] <= device.capacity
    assert not all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
