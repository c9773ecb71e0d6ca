"""A model built with its parameters on the meta device (harmony.empty_weights):
the engine makes the weights where they live, those on the disk tier one
update at a time, never all in host memory, and trains bitwise like the same
weights made in memory (harmony.materialize); it resumes from a checkpoint;
a failed set-up leaves the weights unmade, to be made again; what it cannot
make is said before anything runs."""

from __future__ import annotations

import pytest
import test_disk_tier_engine as t
import torch
from torch import nn

import harmony
from harmony import Engine, HarmonyError, empty_weights, materialize
from harmony.engine.disk_staging import StateOnDisk
from harmony.engine.lazy_weights import has_memory


@pytest.fixture(autouse=True)
def budgets_for_the_state_alone(monkeypatch):
    t.state_alone(monkeypatch.setattr)


def meta_model() -> nn.Sequential:
    with empty_weights():
        return t.make_model()


def live_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters that have memory (per storage)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in model.parameters()
        if has_memory(p)
    }
    return sum(storages.values())


def engine(model, plan, host=t.ROOMY, tier=None, **kw) -> Engine:
    if tier is not None:
        kw.update(disk_dir=tier, disk=t.FAST_DISK)
    return Engine(
        model,
        t.adamw,
        nn.functional.mse_loss,
        device=t.device(plan.n_gpus),
        minibatch_size=t.B,
        plan=plan,
        hardware=t.hardware(plan.n_gpus),
        host_memory=host,
        **kw,
    )


def materialized(plan, steps: int, **kw) -> dict:
    """The weights of the run whose model was made in memory by materialize."""
    e = engine(materialize(meta_model(), **kw), plan)
    return t.weights(t.train(e, steps))


def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with empty_weights():
        layers = harmony.zoo.build("gpt2-tiny", device="cpu", n_layer=2)
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    mask = layers[1].attn.causal_bias
    assert not mask.is_meta and torch.isinf(mask[0, 1]) and mask[1, 0] == 0
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # only inside the block


@pytest.mark.parametrize(
    "policy, gpus, kinds",
    [("harmony-pp", 1, 1), ("harmony-pp", 1, 2), ("harmony-dp", 2, 2)],
    ids=["pp-optimizer", "pp-weights", "dp-weights"],
)
def test_weights_are_made_where_they_live_and_train_like_made_in_memory(
    tmp_path, policy, gpus, kinds
):
    plan = t.plan_for(policy, gpus)
    host = (t.OPTIMIZER_ON_DISK, t.WEIGHTS_ON_DISK[gpus])[kinds - 1]
    model = meta_model()
    live = []  # bytes of weights in memory each time a layer is initialised
    e = engine(
        model,
        plan,
        host,
        tmp_path / "tier",
        init=lambda layer: live.append(live_weight_bytes(model)),
    )
    try:
        assert live_weight_bytes(model) == 0
        t.train(e, 3)
        assert len({k for _, k in e.disk.placement.on_disk}) == kinds
        linear = (t.D * t.D + t.D) * 4
        assert len(live) == t.LAYERS // 2  # every layer with weights made once
        if kinds == 2:  # all on disk: one layer's weights in memory at a time, made for the tier
            assert max(live) == linear and live_weight_bytes(model) == 0
        else:  # made in place in the flat layout
            assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
            assert max(live) == live_weight_bytes(model) == 8 * linear
        assert t.same(t.weights(e), materialized(plan, 3, init=lambda layer: None))
    finally:
        e.close()


def test_a_run_of_unmade_weights_resumes_bitwise(tmp_path):
    plan = t.plan_for("harmony-pp", 1)
    e = t.train(engine(meta_model(), plan, t.WEIGHTS_ON_DISK[1], tmp_path / "tier"), 2)
    e.save(tmp_path / "run.ckpt")
    e.close()
    again = Engine.load(
        tmp_path / "run.ckpt",
        meta_model(),
        t.adamw,
        nn.functional.mse_loss,
        device=t.device(1),
        hardware=t.hardware(1),
        host_memory=t.WEIGHTS_ON_DISK[1],
        disk=t.FAST_DISK,
    )
    try:
        assert t.same(t.weights(t.train(again, 4)), materialized(plan, 4))
    finally:
        again.close()


def test_a_set_up_that_fails_leaves_the_weights_unmade(tmp_path, monkeypatch):
    """The tier fails while taking the third update's weights: every weight made
    for it goes back to unmade, and the next step makes them all again."""
    plan = t.plan_for("harmony-pp", 1)
    model = meta_model()
    e = engine(model, plan, t.WEIGHTS_ON_DISK[1], tmp_path / "tier")
    write, calls = StateOnDisk.write, []

    def failing(self, unit, kinds, release):
        calls.append(unit.key)
        if len(calls) == 3:
            raise OSError("disk full")
        return write(self, unit, kinds, release)

    monkeypatch.setattr(StateOnDisk, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        e.step(*t.batch(0))
    assert e.disk is None and live_weight_bytes(model) == 0
    assert len(e.unmade.pending) == 2 * (t.LAYERS // 2)
    monkeypatch.setattr(StateOnDisk, "write", write)
    try:
        assert t.same(t.weights(t.train(e, 3)), materialized(plan, 3))
    finally:
        e.close()


def test_a_shared_parameter_is_made_by_its_first_layer_only():
    """Layer 1 uses layer 0's weight: layer 1's initialisation does not see it."""
    with empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight

    def init(layer):
        for p in layer.parameters():
            nn.init.constant_(p, 1.0 if layer is model[0] else 2.0)

    materialize(model, init)
    assert model[1].weight is model[0].weight
    assert (model[0].weight == 1).all() and (model[1].bias == 2).all()


def test_a_tied_gpt2_made_by_the_engine_trains_like_made_in_memory(monkeypatch):
    """GPT-2 with its LM head tied to the token embedding, its initialisation
    (N(0, 0.02)) given as init=, plan="auto" (profiled on the unmade model)."""
    import test_gradient_slots as g

    from harmony.costs.zoo.modules import init_transformer

    def tied():
        with empty_weights():
            return g.tied_gpt2()

    def run(model, plan, **kw):
        return g.train_gpt2(model, plan, t.device(1), steps=2, seed=3, **kw)

    made = run(tied(), "auto", init=init_transformer)
    twin = materialize(tied(), init_transformer, seed=3)
    assert twin[-1].lm_head.weight is twin[0].wte.weight
    assert abs(float(twin[0].wte.weight.detach().std()) - 0.02) < 2e-3
    assert t.same(t.weights(made), t.weights(run(twin, made.plan)))


def test_what_cannot_be_made_is_said_before_anything_runs():
    plan = t.plan_for("harmony-pp", 1)
    meta_buffers = nn.Sequential(*harmony.zoo.build("gpt2-tiny", device="meta", n_layer=1)[:-1])
    with pytest.raises(HarmonyError, match=r"buffer on the meta device.*harmony.empty_weights"):
        engine(meta_buffers, plan)
    with pytest.raises(HarmonyError, match="this model's weights are made already"):
        engine(t.make_model(), plan, init=lambda layer: None)
    with pytest.raises(HarmonyError, match="init must be a function of a layer"):
        engine(meta_model(), plan, init="normal")

    class Scale(nn.Module):  # a parameter no reset_parameters() sets
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(t.D))

        def forward(self, x):
            return x * self.scale

    with empty_weights():
        model = nn.Sequential(nn.Linear(t.D, t.D), Scale())
    e = engine(model, harmony.Plan("harmony-pp", 1, t.B, 2, 2, ((0, 1),), ((0, 1), (1, 2))))
    with pytest.raises(HarmonyError, match="before the first step|step first"):
        e.state_dict()
    with pytest.raises(HarmonyError, match=r"layer 1 \(Scale\): scale was left unset"):
        e.step(*t.batch(0))


def test_a_model_profiled_on_the_meta_device_is_then_made_by_the_engine(tmp_path):
    """harmony.profile measures the unmade model (placeholders); the engine given
    that profile still makes its weights, as materialize does."""
    plan = t.plan_for("harmony-pp", 1)
    model = meta_model()
    spec = harmony.profile(list(model), *t.batch(0), nn.functional.mse_loss, t.adamw, repeats=1)
    assert spec.has_times and live_weight_bytes(model) == 0
    e = engine(model, plan, t.WEIGHTS_ON_DISK[1], tmp_path / "tier", spec=spec)
    try:
        assert t.same(t.weights(t.train(e, 2)), materialized(plan, 2))
    finally:
        e.close()


def test_weights_another_engine_left_on_its_tier_are_not_made_anew(tmp_path):
    plan = t.plan_for("harmony-pp", 1)
    first = t.train(engine(t.make_model(), plan, t.WEIGHTS_ON_DISK[1], tmp_path / "tier"), 1)
    first.close()
    again = engine(first.model, plan)  # its master weights are placeholders now
    with pytest.raises(HarmonyError, match="lives on another engine's disk tier"):
        again.step(*t.batch(0))


def test_harmony_train_makes_its_model_where_it_lives(monkeypatch):
    """On one server ``harmony train`` never builds the model in memory first: its
    weights are made_model's (lr 0 leaves them as made)."""
    from harmony.workbench import training

    def refused(*a, **kw):
        raise AssertionError("built in memory")

    made = training.made_model("gpt2-tiny", 5, n_layer=2).state_dict()
    monkeypatch.setattr(training, "build_model", refused)
    device = harmony.EmulatedDevice("4MB", "1GB/s", "1GB/s")
    run = training.train("gpt2-tiny", 1, 4, device, lr=0.0, seed=5, log=lambda s: None, n_layer=2)
    assert t.same(run.engine.model_state_dict(), made)
