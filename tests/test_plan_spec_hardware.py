"""Plan, cost model (Curve, ModelSpec, reference profiles) and Hardware."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from conftest import tiny_spec

import harmony
from harmony import (
    Curve,
    Hardware,
    HarmonyError,
    LayerCost,
    ModelSpec,
    Plan,
    parse_bytes,
    parse_rate,
    preset,
)
from harmony.costs import reference
from harmony.plan import DEFAULT_OPTIONS

PLAN = Plan(
    "harmony-pp",
    2,
    16,
    4,
    2,
    ((0, 3), (3, 5)),
    ((0, 2), (2, 5), (5, 8)),
    {"offload_activations": True, "prefetch_packs": 3},
)


def _plan(**kw) -> Plan:
    d = dict(
        policy="harmony-pp",
        n_gpus=1,
        minibatch=8,
        fwd_microbatch=4,
        bwd_microbatch=2,
        fwd_packs=((0, 2), (2, 3)),
        bwd_packs=((0, 1), (1, 3), (3, 4)),
        options={},
    )
    d.update(kw)
    return Plan(**d)


# ---- Plan: values and JSON ----------------------------------------------------------------
def test_plan_json_round_trip_text_and_file(tmp_path):
    text = PLAN.to_json()
    assert json.loads(text)["bwd_packs"] == [[0, 2], [2, 5], [5, 8]]
    assert Plan.from_json(text) == PLAN
    path = tmp_path / "plan.json"
    assert PLAN.to_json(path) == text
    assert Plan.from_json(path) == PLAN
    assert Plan.from_json(str(path)) == PLAN
    assert Plan.from_dict(PLAN.to_dict()) == PLAN


def test_plan_is_a_hashable_value():
    same = Plan(
        "harmony-pp",
        2,
        16,
        4,
        2,
        [[0, 3], [3, 5]],
        [[0, 2], [2, 5], [5, 8]],
        {"prefetch_packs": 3, "offload_activations": True},
    )
    assert same == PLAN and hash(same) == hash(PLAN)
    assert len({PLAN, same}) == 1
    assert dataclasses.replace(PLAN, minibatch=32) != PLAN
    assert Plan("harmony-pp", 1, 4, 4, 4, (), ((0, 2),)) != Plan(
        "harmony-pp", 1, 4, 4, 4, (), ((0, 2),), {"prefetch_packs": 1}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLAN.minibatch = 3  # type: ignore[misc]


def test_plan_options_and_defaults():
    p = _plan()
    assert p.option("prefetch_packs") == 2 and p.option("offload_activations") is False
    assert PLAN.option("prefetch_packs") == 3
    assert p.stash_layers() == (0, 1)
    assert p.num_layers == 4
    assert p.fwd_microbatches() == [(0, 4), (4, 8)]
    assert _plan(bwd_microbatch=3).bwd_microbatches() == [(0, 3), (3, 6), (6, 8)]
    assert "harmony-pp" in p.describe()


def test_valid_plan_validates():
    plan = _plan()
    assert plan.validate(4) is plan
    assert Plan("harmony-no-grouping", 1, 1, 1, 1, (), ((0, 1),)).validate(1)


def test_plan_with_a_pack_that_is_not_a_pair_is_rejected_when_built():
    with pytest.raises(
        HarmonyError, match=r"bwd_packs must be a list of \[start, stop\] integer layer ranges"
    ):
        _plan(bwd_packs=((0, 1, 2), (2, 4)))


@pytest.mark.parametrize(
    "kw, num_layers, message",
    [
        (
            dict(bwd_packs=((0, 2), (1, 3), (3, 4))),
            4,
            r"bwd_packs: pack \(1, 3\) overlaps the previous pack",
        ),
        (
            dict(bwd_packs=((0, 1), (2, 3), (3, 4))),
            4,
            r"bwd_packs: pack \(2, 3\) leaves layers 1..1 uncovered",
        ),
        (dict(bwd_packs=((0, 1), (1, 3))), 4, r"bwd_packs must cover layers 0..3.*end at layer 2"),
        (
            dict(bwd_packs=((0, 1), (1, 3), (3, 6))),
            4,
            r"bwd_packs must cover layers 0..3.*end at layer 5",
        ),
        (dict(bwd_packs=((0, 1), (1, 1), (1, 4))), 4, r"pack \(1, 1\) is empty or reversed"),
        (dict(bwd_packs=((0, 2), (2, 1), (1, 4))), 4, r"pack \(2, 1\) is empty or reversed"),
        (dict(bwd_packs=()), 4, r"bwd_packs is empty"),
        (
            dict(fwd_packs=((0, 2),)),
            4,
            r"fwd_packs must cover layers 0..2 \(forward packs stop where the fused",
        ),
        (dict(fwd_packs=((0, 2), (2, 4))), 4, r"fwd_packs must cover layers 0..2"),
        (
            dict(fwd_packs=((0, 1), (2, 3))),
            4,
            r"fwd_packs: pack \(2, 3\) leaves layers 1..1 uncovered",
        ),
        # fine: one fused pack, no forward packs
        (dict(fwd_packs=(), bwd_packs=((0, 4),)), 4, None),
        (dict(fwd_packs=((0, 4),), bwd_packs=((0, 4),)), 4, r"fwd_packs must cover layers 0..-1"),
        (dict(fwd_microbatch=9), 4, r"fwd_microbatch=9 is larger than the minibatch \(8\)"),
        (dict(bwd_microbatch=16), 4, r"bwd_microbatch=16 is larger than the minibatch \(8\)"),
        (dict(minibatch=0), 4, r"minibatch must be a positive integer, got 0"),
        (dict(n_gpus=0), 4, r"n_gpus must be a positive integer, got 0"),
        (dict(fwd_microbatch=-1), 4, r"fwd_microbatch must be a positive integer, got -1"),
        (dict(bwd_microbatch=2.5), 4, r"bwd_microbatch must be a positive integer, got 2.5"),
        (dict(options={"prefetch_packs": 0}), 4, r"prefetch_packs must be an integer >= 1, got 0"),
        (
            dict(options={"prefetch_packs": "2"}),
            4,
            r"prefetch_packs must be an integer >= 1, got '2'",
        ),
    ],
)
def test_plan_validation_errors(kw, num_layers, message):
    plan = _plan(**kw)
    if message is None:
        plan.validate(num_layers)
        return
    with pytest.raises(HarmonyError, match=message) as err:
        plan.validate(num_layers)
    assert str(err.value).startswith("invalid plan (harmony-pp): ")


def test_unknown_option_is_rejected_at_construction():
    known = re.escape(str(sorted(DEFAULT_OPTIONS)))
    with pytest.raises(
        HarmonyError, match=r"unknown plan option\(s\) \['prefetch'\]; known options: " + known
    ):
        _plan(options={"prefetch": 2})


def test_plan_json_errors(tmp_path):
    d = PLAN.to_dict()
    with pytest.raises(HarmonyError, match=r"unexpected keys \['colour'\]"):
        Plan.from_json(json.dumps({**d, "colour": "red"}))
    missing = {k: v for k, v in d.items() if k != "minibatch"}
    with pytest.raises(HarmonyError, match=r"missing keys \['minibatch'\]"):
        Plan.from_json(json.dumps(missing))
    no_options = {k: v for k, v in d.items() if k != "options"}
    assert Plan.from_json(json.dumps(no_options)).options == ()
    with pytest.raises(HarmonyError, match="not valid JSON"):
        Plan.from_json('{"policy": "harmony-pp",')
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HarmonyError, match="not valid JSON"):
        Plan.from_json(bad)
    with pytest.raises(HarmonyError, match=r"plan file .*nope\.json.* does not exist"):
        Plan.from_json(tmp_path / "nope.json")
    with pytest.raises(HarmonyError, match="unknown plan option"):
        Plan.from_json(json.dumps({**d, "options": {"speed": "max"}}))


@pytest.mark.parametrize("packs", [[1, 2], [["a", "b"]], [[0, None]]])
def test_malformed_packs_in_json_raise_harmony_error(packs):
    d = {**PLAN.to_dict(), "bwd_packs": packs}
    with pytest.raises(HarmonyError, match="bwd_packs"):
        Plan.from_json(json.dumps(d))


@pytest.mark.parametrize("options", [None, "fast"])
def test_malformed_options_in_json_raise_harmony_error(options):
    d = {**PLAN.to_dict(), "options": options}
    with pytest.raises(HarmonyError, match="options"):
        Plan.from_json(json.dumps(d))


def test_empty_plan_text_raises_harmony_error():
    with pytest.raises(HarmonyError):
        Plan.from_json("")


def test_non_bool_offload_option_is_rejected():
    with pytest.raises(HarmonyError, match="offload_activations"):
        _plan(options={"offload_activations": "no"}).validate(4)


def test_plan_accepts_numpy_integers():
    np = pytest.importorskip("numpy")
    plan = Plan("harmony-pp", np.int64(1), np.int64(8), np.int64(4), 4, (), ((0, 2),))
    plan.validate(2)
    assert Plan.from_json(plan.to_json()) == Plan("harmony-pp", 1, 8, 4, 4, (), ((0, 2),))


# ---- Curve ------------------------------------------------------------------------------------
def test_curve_table_interpolates_extrapolates_and_is_flat_below():
    c = Curve.table([4, 1, 2], [3.0, 1.0, 2.0])  # sorted on construction
    assert c.us == (1, 2, 4) and c.values == (1.0, 2.0, 3.0)
    assert c.measured and c.max_measured_u == 4
    assert c(1) == 1.0 and c(2) == 2.0 and c(4) == 3.0  # exact at measured points
    assert c(3) == pytest.approx(2.5)
    assert c(1.5) == pytest.approx(1.5)
    assert c(8) == pytest.approx(5.0)  # last segment, slope 1/2
    assert c(0.5) == 1.0 and c(0) == 1.0  # flat below the first point
    falling = Curve.table([1, 2], [4.0, 1.0])
    assert falling(3) == 0.0 and falling(10) == 0.0  # never negative
    single = Curve.table([4], [2.0])
    assert single(8) == pytest.approx(4.0) and single(2) == pytest.approx(1.0)  # proportional
    with pytest.raises(HarmonyError, match="at least one point"):
        Curve.table([], [])


def test_curve_linear_and_scaled():
    c = Curve.linear(2.0, 1.0)
    assert not c.measured and c.max_measured_u is None
    assert c(0) == 1.0 and c(3) == 7.0
    assert c.scaled(0.5)(3) == 3.5
    t = Curve.table([1, 2], [10.0, 30.0]).scaled(2)
    assert t(1) == 20.0 and t(1.5) == pytest.approx(40.0) and t.us == (1, 2)


def test_curve_with_repeated_size_is_rejected_or_usable():
    try:
        c = Curve.table([1, 2, 2], [1.0, 2.0, 3.0])
    except HarmonyError:
        return
    assert c(3) >= 0.0


# ---- ModelSpec ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optimizer, slots", [("sgd", 0), ("sgd-momentum", 1), ("adam", 2), ("adamw", 2)]
)
def test_spec_bytes_per_optimizer(optimizer, slots):
    spec = tiny_spec(3, params=1000, optimizer=optimizer)
    assert spec.num_params == 3000
    assert (
        spec.weight_bytes() == 12_000
        and spec.weight_bytes(1, 3) == 8_000
        and spec.weight_bytes(1, 1) == 0
    )
    assert spec.grad_bytes() == 12_000
    assert spec.optimizer_state_bytes() == 12_000 * slots
    assert spec.optimizer_state_bytes(0, 1) == 4_000 * slots
    # without a measured update time: (weights, gradient, every state tensor) read and written
    plain = ModelSpec(
        "p",
        tuple(dataclasses.replace(c, update_time_s=None) for c in spec.layers),
        optimizer=optimizer,
    )
    assert plain.update_time(0, 3, 1e6) == pytest.approx(3000 * 4 * (3 + 2 * slots) / 1e6)
    assert spec.update_time(0, 3, 1e6) == pytest.approx(3 * 0.01)  # measured wins


def test_spec_buffers_count_as_weights_not_gradients():
    layer = LayerCost("bn", param_numel=100, buffer_numel=50)
    spec = ModelSpec("b", (layer,), optimizer="adam")
    assert spec.weight_bytes() == 600 and spec.grad_bytes() == 400
    assert spec.optimizer_state_bytes() == 800 and spec.num_params == 100


def test_spec_dtypes():
    layer = LayerCost(
        "emb",
        param_numel=1000,
        input_numel_per_sample=10,
        input_fixed_bytes_per_sample=16,
        fwd_extra=Curve.linear(100.0),
        bwd_extra=Curve.linear(300.0),
    )
    spec = ModelSpec("d", (layer, layer), target_bytes_per_sample=8)
    assert spec.input_bytes(0, 2) == 2 * (10 * 4 + 16)
    assert spec.input_bytes(2, 2) == 0.0  # the loss output
    half_w = spec.with_dtypes(param_dtype="bfloat16")
    assert half_w.weight_bytes() == spec.weight_bytes() / 2
    assert half_w.grad_bytes() == spec.grad_bytes() / 2
    assert half_w.optimizer_state_bytes() == spec.optimizer_state_bytes()  # fp32 on the host
    assert half_w.input_bytes(0, 2) == spec.input_bytes(0, 2)
    half_a = spec.with_dtypes(act_dtype="bfloat16")
    assert half_a.weight_bytes() == spec.weight_bytes()
    assert half_a.input_bytes(0, 2) == 2 * (10 * 2 + 16)  # integer inputs keep their size
    # forward: the worst layer, the second holding its input (an inner activation) too
    assert half_a.fwd_work_bytes(0, 2, 4) == pytest.approx(200.0 + 4 * (10 * 2 + 16))
    assert half_a.bwd_work_bytes(0, 2, 4) == pytest.approx(1200.0)
    assert spec.fwd_work_bytes(0, 2, 4) == pytest.approx(400.0 + 4 * (10 * 4 + 16))
    # one layer: what it makes but its output, which is the pack's output buffer
    assert spec.fwd_work_bytes(0, 1, 4) == pytest.approx(400.0 - 4 * (10 * 4 + 16))
    assert spec.bwd_work_bytes(0, 2, 4) == pytest.approx(2400.0)  # sum over layers
    assert half_a.target_bytes(3) == spec.target_bytes(3) == 24
    back = half_a.with_dtypes(act_dtype="float32")
    assert back.fwd_work_bytes(0, 2, 4) == pytest.approx(spec.fwd_work_bytes(0, 2, 4))


def test_working_memory_counts_a_tensor_kept_by_two_layers_once():
    """bwd_extra includes the layer's own input and output when autograd keeps
    them: the pack's input is a buffer of its own, and the tensor between two
    layers of a pack is one tensor however many layers keep it."""

    def layer(saved_in: float, saved_out: float) -> LayerCost:
        return LayerCost(
            "l",
            param_numel=10,
            input_numel_per_sample=25,
            bwd_extra=Curve.linear(300.0),
            saved_input=Curve.linear(saved_in),
            saved_output=Curve.linear(saved_out),
        )

    keeps_output, keeps_input = layer(0.0, 100.0), layer(100.0, 0.0)
    spec = ModelSpec("k", (keeps_output, keeps_input, keeps_input))
    assert spec.bwd_work_bytes(0, 1, 2) == pytest.approx(600.0)
    # its input is the pack's buffer
    assert spec.bwd_work_bytes(1, 2, 2) == pytest.approx(600.0 - 200.0)
    # one tensor between the two
    assert spec.bwd_work_bytes(0, 2, 2) == pytest.approx(1200.0 - 200.0)
    assert spec.bwd_work_bytes(0, 3, 2) == pytest.approx(1800.0 - 200.0)  # layer 1 keeps no output
    half = spec.with_dtypes(act_dtype="bfloat16")
    assert half.bwd_work_bytes(0, 2, 2) == pytest.approx(500.0)
    assert spec.with_dtypes(param_dtype="float64").weight_bytes() == 2 * spec.weight_bytes()


def test_spec_times_from_curves_or_flops():
    measured = LayerCost("m", 10, fwd_time=Curve.linear(1e-3), bwd_time=Curve.linear(3e-3))
    flops = LayerCost("f", 10, fwd_flops_per_sample=2e9, bwd_flops_per_sample=6e9)
    spec = ModelSpec("t", (measured, flops))
    assert spec.fwd_time(0, 2, 4, 1e12) == pytest.approx(4e-3 + 8e-3)
    assert spec.bwd_time(0, 2, 4, 1e12) == pytest.approx(12e-3 + 24e-3)
    assert spec.bwd_time(1, 2, 4, 2e12) == pytest.approx(12e-3)


def test_spec_errors():
    layer = LayerCost("l", 1)
    with pytest.raises(
        HarmonyError, match=r"unknown dtype 'float8'; use one of \['bfloat16', 'float16'"
    ):
        ModelSpec("x", (layer,), param_dtype="float8")
    with pytest.raises(HarmonyError, match="unknown dtype 'int4'"):
        ModelSpec("x", (layer,), act_dtype="int4")
    with pytest.raises(HarmonyError, match="unknown dtype 'fp8'"):
        ModelSpec("x", (layer,)).with_dtypes(act_dtype="fp8")
    with pytest.raises(
        HarmonyError,
        match=r"unknown optimizer 'lion'; use one of \[.*'adamw'.*'sgd'.*or 'slots:N'",
    ):
        ModelSpec("x", (layer,), optimizer="lion")
    with pytest.raises(HarmonyError, match="unknown optimizer 'lion'"):
        ModelSpec("x", (layer,)).with_optimizer("lion")
    with pytest.raises(HarmonyError, match="model spec 'empty' has no layers"):
        ModelSpec("empty", ())


def test_spec_summary():
    s = tiny_spec(3).summary()
    assert s["layers"] == 3 and s["params"] == 3_000_000 and s["weight_bytes"] == 12_000_000
    assert s["optimizer_state_bytes"] == 24_000_000 and s["optimizer"] == "adamw"


# ---- reference profiles -------------------------------------------------------------------------
REF_DIR = Path(reference.__file__).parent / "data" / "reference" / "harmony-1080ti"


def test_gpt2_xl_reference_profile():
    spec = reference.load("gpt2-xl")
    assert len(spec) == 52
    assert spec.num_params == 1_638_022_400
    assert sum(c.update_time_s for c in spec.layers) == pytest.approx(2.210, abs=5e-4)
    assert spec.optimizer == "adamw"
    times = pd.read_csv(REF_DIR / "gpt2_xl.times.csv")
    for layer, u, phase in [(5, 4, "FWD"), (0, 1, "FWD"), (51, 2, "BWD"), (20, 3, "BWD")]:
        row = times[(times.layer == layer) & (times.ubatch_size == u) & (times.phase == phase)]
        assert len(row) == 1
        curve = spec.layers[layer].fwd_time if phase == "FWD" else spec.layers[layer].bwd_time
        assert curve(u) == row.time_s.iloc[0]  # exactly, at a profiled size
    # token ids are integers: their bytes do not scale with the activation dtype
    assert (
        spec.layers[0].input_numel_per_sample == 0
        and spec.layers[0].input_fixed_bytes_per_sample == 8192
    )
    assert spec.layers[1].input_numel_per_sample == 1024 * 1600
    assert harmony.model_spec("gpt2-xl") is spec


@pytest.mark.parametrize("name", sorted(reference.VARIANTS))
def test_every_reference_variant_loads(name):
    spec = reference.load(name)
    assert len(spec) > 1 and spec.num_params > 0
    assert all(c.fwd_time is not None and c.fwd_time.measured for c in spec.layers)
    assert all(c.bwd_time(1) > 0 and c.update_time_s is not None for c in spec.layers)
    fcap, bcap = reference.max_profiled(spec)
    assert fcap >= 1 and bcap >= 1


@pytest.mark.parametrize("name, gb", [("bert-large", 1.341), ("vgg416", 2.312)])
def test_reference_weight_totals(name, gb):
    assert reference.load(name).weight_bytes() / 1e9 == pytest.approx(gb, rel=1e-3)


def test_unknown_reference_profile():
    with pytest.raises(
        HarmonyError, match="no reference profile for 'gpt5'; profiled models: bert-large"
    ):
        reference.load("gpt5")
    with pytest.raises(HarmonyError, match="unknown model 'gpt5'; known models: "):
        harmony.model_spec("gpt5")
    with pytest.raises(HarmonyError, match="unknown spec source"):
        harmony.model_spec("gpt2-xl", source="internet")


# ---- Hardware -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["paper-4x1080ti", "paper-8x1080ti", "h100-pcie5", "8x4090-pcie4"]
)
def test_presets_exist(name):
    hw = preset(name)
    assert hw.name == name and hw is harmony.PRESETS[name]
    assert hw.gpu_memory > 0 and hw.h2d > 0
    assert hw.to_dict()["n_gpus"] == hw.n_gpus


def test_paper_presets():
    four, eight = preset("paper-4x1080ti"), preset("paper-8x1080ti")
    assert four.n_gpus == 4 and eight.n_gpus == 8
    assert four.gpu_memory == 10 * 2**30
    assert [four.switch_of(g) for g in range(4)] == [0, 0, 0, 0]
    assert [eight.switch_of(g) for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert preset("8x4090-pcie4").p2p is None
    two = four.with_gpus(2)
    assert two.n_gpus == 2 and two.name == "paper-4x1080ti[2 gpus]"
    assert four.with_gpus(4) == four


def test_unknown_preset_lists_names():
    with pytest.raises(HarmonyError) as err:
        preset("nope")
    msg = str(err.value)
    assert "'nope'" in msg
    for name in harmony.PRESETS:
        assert name in msg


@pytest.mark.parametrize(
    "value, expected",
    [
        ("256MB", 256_000_000),
        ("1.5GiB", 1_610_612_736),
        (1024, 1024),
        ("4096", 4096),
        (" 2 KiB ", 2048),
        ("1e3kb", 1_000_000),
        ("3tb", 3 * 10**12),
        (0, 0),
        ("10b", 10),
    ],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("12XB", r"cannot read size '12XB'.*units: b, kb"),
        (-1, r"size must be non-negative, got -1"),
        ("-5MB", r"cannot read size '-5MB'"),
        ("MB", r"cannot read size 'MB'"),
        (True, r"cannot read size True"),
    ],
)
def test_parse_bytes_errors(value, message):
    with pytest.raises(HarmonyError, match=message):
        parse_bytes(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1e400MB"])
def test_parse_bytes_rejects_non_finite(value):
    with pytest.raises(HarmonyError):
        parse_bytes(value)


def test_parse_rate():
    assert parse_rate("200MB/s") == 2e8
    assert parse_rate("1.5 GiB/sec") == 1.5 * 2**30
    assert parse_rate("10 GB / s") == 1e10
    assert parse_rate(5e9) == 5e9
    with pytest.raises(HarmonyError, match=r"bandwidth must be positive, got '0MB/s'"):
        parse_rate("0MB/s")
    with pytest.raises(HarmonyError, match="bandwidth must be positive"):
        parse_rate(0)
    with pytest.raises(HarmonyError, match=r"cannot read link 'fast'"):
        parse_rate("fast", "link")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(h2d=-1.0), r"hardware 'paper-4x1080ti': h2d must be a positive number, got -1.0"),
        (dict(uplink=0.0), r"uplink must be a positive number"),
        (dict(d2h=float("nan")), r"d2h must be a positive number, got nan"),
        (dict(n_gpus=0), r"n_gpus must be >= 1, got 0"),
        (dict(gpus_per_switch=0), r"gpus_per_switch must be >= 1"),
        (dict(cpu_update_workers=0), r"cpu_update_workers must be >= 1"),
        (dict(gpu_memory=0), r"gpu_memory must be a positive number"),
        (dict(p2p=0.0), r"p2p must be positive or None, got 0.0"),
    ],
)
def test_invalid_hardware(change, message):
    with pytest.raises(HarmonyError, match=message):
        dataclasses.replace(preset("paper-4x1080ti"), **change)


def test_fractional_gpu_count_is_rejected():
    with pytest.raises(HarmonyError, match="n_gpus"):
        dataclasses.replace(preset("paper-4x1080ti"), n_gpus=1.5)


def test_hardware_is_a_value():
    a = Hardware("x", 1, 10, 1e12, 1e9, 1e9, 1e9, 1, None, 1e9, 1, 10)
    assert a == Hardware("x", 1, 10, 1e12, 1e9, 1e9, 1e9, 1, None, 1e9, 1, 10)
    assert hash(a) == hash(dataclasses.replace(a))


def test_bits_are_not_mistaken_for_bytes():
    with pytest.raises(HarmonyError, match="reads as bits"):
        parse_rate("10Gb/s")
    assert parse_rate("0.5") == 0.5  # fractional rates are kept, not truncated to 0
