"""Precision is part of the plan: the search and the simulator plan a mixed-precision
run, and the engine refuses a plan made for another precision."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import harmony
from harmony.errors import HarmonyError


@pytest.fixture(scope="module")
def spec():
    return harmony.model_spec("gpt2-medium")


HW = harmony.preset("paper-4x1080ti")


def test_a_bf16_plan_moves_half_the_bytes_of_the_same_fp32_plan(spec):
    plan = harmony.Plan.uniform("harmony-pp", 1, 16, 4, num_layers=len(spec), layers_per_pack=4)
    fp32 = harmony.simulate(spec, HW, plan).summary
    bf16 = harmony.simulate(spec, HW, plan.with_options(precision="bf16")).summary
    for kind in ("W_IN", "G_OUT", "STASH_OUT", "STASH_IN"):
        assert bf16.bytes_by_kind[kind] == pytest.approx(fp32.bytes_by_kind[kind] / 2, rel=0.01), (
            kind
        )
    assert (
        harmony.swap_volume(spec, plan.with_options(precision="bf16"))["W_IN"]
        == bf16.bytes_by_kind["W_IN"]
    )


def test_the_search_plans_in_a_precision_and_its_plans_carry_it(spec):
    df = harmony.search(
        spec, HW, 16, policies=["harmony-pp"], n_gpus=1, workers=1, precision="bf16"
    )
    best = df.iloc[0].plan
    assert best.option("precision") == "bf16"
    assert harmony.Plan.from_json(best.to_json()) == best
    assert harmony.simulate(spec, HW, best).summary.fits


def test_precision_is_idempotent_and_only_from_float32(spec):
    bf16 = spec.in_precision("bf16")
    assert bf16.precision == "bf16" and bf16.in_precision("bf16") is bf16
    assert bf16.master_dtype == "float32"
    with pytest.raises(HarmonyError, match="only a float32 spec"):
        bf16.in_precision("fp16")
    with pytest.raises(HarmonyError, match="precision must be one of"):
        spec.in_precision("int8")


def test_a_plan_with_an_unknown_precision_is_refused():
    with pytest.raises(HarmonyError, match="option precision must be"):
        harmony.Plan.uniform(
            "harmony-pp", 1, 4, 1, num_layers=3, layers_per_pack=1, precision="fp8"
        ).validate()


def test_the_engine_refuses_a_plan_for_another_precision():
    model = torch.nn.Sequential(*harmony.zoo.build("gpt2-tiny", device="cpu")[:-1])
    plan = harmony.Plan.uniform(
        "harmony-pp", 1, 4, 2, num_layers=len(model), layers_per_pack=1, precision="bf16"
    )
    with pytest.raises(HarmonyError, match="make the engine with precision='bf16'"):
        harmony.Engine(
            model,
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()),
            device="cpu",
            minibatch_size=4,
            plan=plan,
        )


def test_the_cli_simulates_a_bf16_run(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "harmony",
            "simulate",
            "--model",
            "gpt2-medium",
            "--minibatch",
            "16",
            "--precision",
            "bf16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    import json

    result = json.loads(out.stdout)
    assert dict(result["plan"]["options"]).get("precision") == "bf16"
