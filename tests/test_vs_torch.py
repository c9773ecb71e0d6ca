"""PyTorch's own offload recipe (:class:`harmony.workbench.baselines.TorchOffload`) trains
exactly as a plain PyTorch loop does, moves the bytes its docstring says, and
runs out of emulated device memory where its ledger says so; the comparison
with harmony (``harmony.workbench.experiments.torch_offload_comparison``) reports both."""

import copy

import pytest
import torch

import harmony
from harmony import EmulatedDevice, FlatAdamW
from harmony.engine.profiler import profile
from harmony.engine.reference_loop import reference_step
from harmony.errors import OutOfMemoryError
from harmony.workbench.baselines import TorchOffload
from harmony.workbench.experiments import torch_offload_comparison
from harmony.workbench.training import build_model, lm_loss

CFG = dict(hidden=32, n_layer=2, heads=2, seq_len=16, max_position=16, vocab=64)
B, U = 4, 2


@pytest.fixture(scope="module")
def setup():
    model = build_model("gpt2-tiny", 0, dropout=0.0, **CFG)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", B, **CFG)
    spec = profile(list(model), (x,), y, lm_loss, sizes=[U], repeats=1)
    return model, x, y, spec


def optimizer(params):
    return FlatAdamW(params, lr=1e-2)


def test_one_step_equals_a_plain_pytorch_step_and_moves_the_documented_bytes(setup):
    model, x, y, spec = setup
    reference = copy.deepcopy(model)
    expected_loss = reference_step(
        list(reference), lm_loss, optimizer(reference.parameters()), (x,), y, U, step=0
    )
    recipe_model = copy.deepcopy(model)
    recipe = TorchOffload(
        recipe_model, optimizer, lm_loss, EmulatedDevice("64MB", "10GB/s", "10GB/s"), U, spec
    )
    loss = recipe.step(x, y)

    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for (name, p), q in zip(recipe_model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        assert not torch.equal(p, model.state_dict()[name]), f"{name} was not updated"
    # saved: each layer's input for every sample (token ids into the embedding,
    # hidden states into the blocks, the final LayerNorm and the LM head)
    params = sum(p.numel() * 4 for p in model.parameters())
    saved = x.numel() * 8 + (len(model) - 1) * B * CFG["seq_len"] * CFG["hidden"] * 4
    assert recipe.moved == {
        "h2d": x.numel() * 8 + y.numel() * 8 + saved + params,
        "d2h": saved + params,
    }
    assert recipe.moved["d2h"] == sum(spec.input_bytes(i, B) for i in range(len(spec))) + params
    assert recipe.ledger.in_use == params * 2 + sum(
        b.numel() * 4 for b in model.buffers()
    )  # step's share released


def test_the_ledger_raises_out_of_memory_where_the_recipe_does_not_fit(setup):
    model, x, y, spec = setup
    weights_and_grads = 2 * sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * 4 for b in model.buffers()
    )
    with pytest.raises(OutOfMemoryError, match="weights and gradients"):
        TorchOffload(
            copy.deepcopy(model),
            optimizer,
            lm_loss,
            EmulatedDevice(weights_and_grads - 1),
            U,
            spec,
        )
    recipe = TorchOffload(
        copy.deepcopy(model), optimizer, lm_loss, EmulatedDevice(weights_and_grads + 1000), U, spec
    )
    with pytest.raises(OutOfMemoryError):
        recipe.step(x, y)
    assert recipe.ledger.in_use == weights_and_grads and all(p.grad is None for p in recipe.params)


def test_the_comparison_runs_both_systems_from_the_same_weights():
    table, details = torch_offload_comparison(
        hidden=32,
        blocks=2,
        minibatch=8,
        memory="400KB",
        steps=1,
        seq_len=16,
        vocab=64,
        link="1GB/s",
    )
    assert list(table.system) == ["harmony-pp", "torch offload"] and (table.status == "ran").all()
    assert details["first_step_max_weight_diff"] < 1e-6  # the same training, step for step
    assert (table.peak_mb <= details["capacity_mb"]).all() and table.harmony_speedup.iloc[0] == 1.0
    assert any(
        "out of memory" in line for line in details["tuning"]
    )  # the whole minibatch does not fit


def test_a_recipe_that_fits_at_no_microbatch_size_gets_a_row_saying_so():
    table, details = torch_offload_comparison(
        hidden=32,
        blocks=6,
        minibatch=8,
        memory="400KB",
        steps=1,
        seq_len=16,
        vocab=64,
        link="1GB/s",
    )
    assert list(table.status) == ["ran", "does not fit at any microbatch size"]
    assert details["weights_mb"] * 2 > details["capacity_mb"]
