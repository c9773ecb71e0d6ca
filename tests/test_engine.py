"""The engine trains exactly like a plain PyTorch loop, within the device's memory."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import harmony
from harmony import EmulatedDevice, Engine, HarmonyError, OutOfMemoryError, Plan, reference_step
from harmony.trace import TIMELINE_COLUMNS

B = 12


class Residual(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(p))

    def forward(self, x):
        return x + self.f(x)


def make_model(dropout: float = 0.1, batchnorm: bool = True) -> nn.Sequential:
    """Nine layers with BatchNorm (or LayerNorm), dropout and residual blocks."""
    torch.manual_seed(0)
    d = 32
    norm = nn.BatchNorm1d(d) if batchnorm else nn.LayerNorm(d)
    return nn.Sequential(
        nn.Linear(16, d),
        norm,
        nn.ReLU(),
        Residual(d, dropout),
        nn.Dropout(dropout),
        Residual(d, dropout),
        nn.Linear(d, d),
        nn.ReLU(),
        nn.Linear(d, 5),
    )


def batches(n: int = 5):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)) for _ in range(n)
    ]


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
SGD_MOMENTUM = lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9)  # noqa: E731
loss_fn = nn.functional.cross_entropy


def lm_loss(out, t):
    """Cross-entropy of a language model's next-token logits."""
    return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())


def reference(optimizer, data, microbatch, dropout=0.1, batchnorm=True):
    model = make_model(dropout, batchnorm)
    opt = optimizer(list(model.parameters()))
    losses = [
        reference_step(list(model), loss_fn, opt, (x,), y, microbatch, step)
        for step, (x, y) in enumerate(data)
    ]
    return model, losses


def train(plan, optimizer, data, device="cpu", dropout=0.1, batchnorm=True):
    model = make_model(dropout, batchnorm)
    engine = Engine(model, optimizer, loss_fn, device=device, minibatch_size=B, plan=plan)
    losses = [engine.step(x, y) for x, y in data]
    return engine, losses


PLANS = [  # (policy, fwd packs, bwd packs)
    ("harmony-pp", ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9))),
    ("harmony-pp", ((0, 2), (2, 5)), ((0, 1), (1, 4), (4, 5), (5, 9))),
    ("harmony-pp", (), ((0, 9),)),
    ("harmony-no-grouping", ((0, 4),), ((0, 4), (4, 9))),
    # one pack reloaded per microbatch: the next load is prefetched before BatchNorm's write-back
    ("harmony-no-grouping", (), ((0, 9),)),
]
DEVICES = ["cpu", EmulatedDevice(memory="4MB", h2d="400MB/s", d2h="400MB/s")]


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "emulated"])
@pytest.mark.parametrize("optimizer", [ADAMW, SGD_MOMENTUM], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("policy, fwd, bwd", PLANS)
def test_bitwise_identical_to_the_reference_loop(device, optimizer, policy, fwd, bwd):
    data = batches()
    expected, ref_losses = reference(optimizer, data, microbatch=4)
    engine, losses = train(Plan(policy, 1, B, 4, 4, fwd, bwd), optimizer, data, device)
    for (name, a), b in zip(engine.model.named_parameters(), expected.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs after {len(data)} steps"
    for (name, a), b in zip(engine.model.named_buffers(), expected.buffers()):
        assert torch.equal(a, b), f"buffer {name} differs"  # BatchNorm updated once per microbatch
    assert losses == ref_losses


def test_different_forward_and_backward_microbatches_are_allclose():
    data = batches(3)
    expected, ref_losses = reference(ADAMW, data, microbatch=2, dropout=0.0, batchnorm=False)
    plan = Plan("harmony-pp", 1, B, 6, 2, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
    engine, losses = train(
        plan,
        ADAMW,
        data,
        EmulatedDevice(memory="4MB", h2d="1GB/s", d2h="1GB/s"),
        dropout=0.0,
        batchnorm=False,
    )
    for a, b in zip(engine.model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b)
    assert losses == pytest.approx(ref_losses)


@pytest.mark.parametrize(
    "dropout, batchnorm, why", [(0.1, False, "dropout"), (0.0, True, "BatchNorm")]
)
def test_microbatch_dependent_layers_with_different_microbatches_are_refused(
    dropout, batchnorm, why
):
    plan = Plan("harmony-pp", 1, B, 6, 2, ((0, 3),), ((0, 3), (3, 9)))
    with pytest.raises(HarmonyError, match=why):
        Engine(make_model(dropout, batchnorm), ADAMW, loss_fn, minibatch_size=B, plan=plan)


def test_trace_has_the_simulator_schema_and_counts_bytes():
    plan = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
    engine, _ = train(
        plan, ADAMW, batches(1), EmulatedDevice(memory="4MB", h2d="1GB/s", d2h="1GB/s")
    )
    trace = engine.trace
    assert list(trace.timeline.columns[: len(TIMELINE_COLUMNS)]) == TIMELINE_COLUMNS
    assert (trace.timeline.end_s >= trace.timeline.start_s).all()
    s = trace.summary
    weights = sum(p.numel() * 4 for p in engine.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in engine.model.buffers())
    # each weight crosses once forward (layers before the fused pack) and once backward
    fwd_weights = sum(
        p.numel() * 4 for layer in list(engine.model)[:6] for p in layer.parameters()
    )
    assert s.bytes_by_kind["W_IN"] == pytest.approx(weights + fwd_weights + 2 * buffers, rel=0.01)
    assert s.bytes_by_kind["G_OUT"] == weights
    assert 0 < s.peak_memory["gpu0"] <= 4e6
    assert s.iteration_s >= s.lower_bound_s * 0.999


def test_out_of_memory_leaves_the_engine_unchanged_and_a_feasible_plan_then_works():
    data = batches(2)
    model = make_model()
    tiny = EmulatedDevice(memory="40KB", h2d="1GB/s", d2h="1GB/s")
    whole = Plan("harmony-pp", 1, B, B, B, (), ((0, 9),))
    engine = Engine(model, ADAMW, loss_fn, device=tiny, minibatch_size=B, plan=whole)
    before = [p.detach().clone() for p in model.parameters()] + [
        b.clone() for b in model.buffers()
    ]
    with pytest.raises(OutOfMemoryError, match=r"needs .* but only .* of 40 KB are free"):
        engine.step(*data[0])
    after = [p.detach() for p in model.parameters()] + list(model.buffers())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(p.grad is None for p in model.parameters())
    assert engine.backend.ledger.in_use == 0
    assert engine.step_count == 0

    # the same engine, given a plan that fits, trains as the reference would
    small = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
    engine.set_plan(small)
    engine.step(*data[0])
    expected, _ = reference(ADAMW, data[:1], microbatch=4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))


def test_an_update_already_applied_is_rolled_back_when_a_later_task_fails():
    """Updates of the last packs run while earlier packs are still in backward (on a
    GPU: the cpu backend, where nothing overlaps, updates after the backward, as a
    plain loop does); a failure there must undo them."""
    model = make_model()
    plan = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
    gpu = EmulatedDevice(memory="4MB", h2d="1GB/s", d2h="1GB/s")
    engine = Engine(model, ADAMW, loss_fn, device=gpu, minibatch_size=B, plan=plan)
    x, y = batches(1)[0]
    engine.step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    states = [
        opt.state_dict()["state"][0]["exp_avg"].clone() for opt in engine.optimizers.values()
    ]
    last_pack = engine.optimizers[(2, 0)]
    stepped = threading.Event()
    original_step = last_pack.step

    def step_and_tell(*args, **kwargs):
        out = original_step(*args, **kwargs)
        stepped.set()
        return out

    last_pack.step = step_and_tell
    calls = {"n": 0}

    def fail_late(module, args):  # 3 forward microbatches, then the recomputes of pack 0
        calls["n"] += 1
        if calls["n"] == 3 + 3:
            assert stepped.wait(10), "the last pack's update never ran"
            raise RuntimeError("injected failure in backward of pack 0")

    handle = engine.layers[0].register_forward_pre_hook(fail_late)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step(x, y)
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(
        torch.equal(opt.state_dict()["state"][0]["exp_avg"], s)
        for opt, s in zip(engine.optimizers.values(), states)
    )


@pytest.mark.parametrize(
    "device, lane_threads", list(zip(DEVICES, [False, True])), ids=["cpu", "emulated"]
)
def test_lanes_get_threads_only_where_their_work_overlaps(device, lane_threads):
    """On the cpu backend nothing overlaps (a transfer hands a tensor over), so the
    calling thread plays every task, updates between compute tasks as in a plain
    loop; an emulated GPU's copies and the host's updates keep their own threads."""
    threads = set()

    def recorded(ps):
        opt = torch.optim.SGD(ps, lr=0.1)
        step = opt.step

        def step_and_note(*args, **kwargs):
            threads.add(threading.current_thread())
            return step(*args, **kwargs)

        opt.step = step_and_note
        return opt

    model = make_model()
    for layer in model:
        layer.register_forward_pre_hook(lambda *_: threads.add(threading.current_thread()))
    plan = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9)))
    engine = Engine(model, recorded, loss_fn, device=device, minibatch_size=B, plan=plan)
    x, y = batches(1)[0]
    threads.clear()  # the engine ran the model once to describe it
    engine.step(x, y)
    assert threading.current_thread() in threads
    assert (len(threads) > 1) == lane_threads


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(optimizer=lambda ps: None), "not a torch.optim.Optimizer"),
        (dict(minibatch_size=0), "minibatch_size must be a positive integer"),
        (dict(device="tpu"), "unknown device 'tpu'"),
        (dict(plan="fast"), "plan must be a harmony.Plan or 'auto'"),
        (dict(plan=Plan("harmony-pp", 1, B, 4, 4, (), ((0, 5),))), "must cover layers 0..8"),
        (
            dict(plan=Plan("harmony-dp", 2, B, 4, 4, (), ((0, 9),))),
            "plan is for 2 GPUs but the engine has 1",
        ),
        (dict(plan=Plan("harmony-pp", 1, 8, 4, 4, (), ((0, 9),))), "plan is for minibatch 8"),
    ],
)
def test_bad_settings_are_refused_up_front(bad, message):
    kwargs = dict(
        model=make_model(),
        optimizer=ADAMW,
        loss_fn=loss_fn,
        minibatch_size=B,
        plan=Plan("harmony-pp", 1, B, 4, 4, (), ((0, 9),)),
    )
    kwargs.update(bad)
    with pytest.raises(HarmonyError, match=message):
        Engine(**kwargs)


def test_a_minibatch_of_the_wrong_size_is_refused():
    engine = Engine(
        make_model(),
        ADAMW,
        loss_fn,
        minibatch_size=B,
        plan=Plan("harmony-pp", 1, B, 4, 4, (), ((0, 9),)),
    )
    with pytest.raises(HarmonyError, match="expected a minibatch of 12"):
        engine.step(torch.randn(5, 16), torch.zeros(5, dtype=torch.long))


def test_inputs_the_model_cannot_take_get_a_clear_error_before_anything_runs():
    engine = Engine(
        make_model(),
        ADAMW,
        loss_fn,
        minibatch_size=B,
        plan=Plan("harmony-pp", 1, B, 4, 4, (), ((0, 9),)),
    )
    with pytest.raises(
        HarmonyError, match=r"cannot run on the given inputs \(\(12, 7\) torch.float32\)"
    ):
        engine.step(torch.randn(B, 7), torch.zeros(B, dtype=torch.long))
    x, y = batches(1)[0]  # the same engine then takes a good minibatch
    engine.step(x, y)
    before = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(HarmonyError, match=r"engine was set up for \[B, 16\] torch.float32"):
        engine.step(x.double(), y)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), before))


def test_auto_plan_trains_a_gpt2_larger_than_the_device():
    layers = harmony.zoo.build("gpt2-tiny", device="cpu", dropout=0.0)[:-1]
    model = nn.Sequential(*layers)
    (x,), y = harmony.zoo.example_input("gpt2-tiny", 16)
    device = EmulatedDevice(memory="1.5MB", h2d="100MB/s", d2h="100MB/s")
    # weights, grads, Adam's two states
    footprint = sum(p.numel() for p in model.parameters()) * 4 * 4
    assert footprint > device.capacity
    engine = Engine(
        model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), lm_loss, device=device, minibatch_size=16
    )
    losses = [engine.step(x, y) for _ in range(4)]
    assert losses[-1] < losses[0]
    assert engine.plan.policy == "harmony-pp" and engine.profile is not None
    assert engine.trace.summary.peak_memory["gpu0"] <= device.capacity


def test_hugging_face_gpt2_with_tied_embeddings_trains_like_the_reference():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 100, (8, 16), generator=g),) * 2 for _ in range(3)]
    ref_model = build()
    chain = harmony.decompose(ref_model)
    assert chain.tied and chain.tied[0][:2] == (0, len(chain) - 1)
    # SGD: Adam's normalised step would blow the last-bit differences of near-zero gradients up
    ref_opt = SGD_MOMENTUM(list(ref_model.parameters()))
    for step, (x, y) in enumerate(data):
        reference_step(chain.layers, lm_loss, ref_opt, (x,), y, 4, step)

    model = build()
    n = len(harmony.decompose(model))
    # embedding and head in different packs
    plan = Plan("harmony-pp", 1, 8, 4, 4, ((0, 2),), ((0, 2), (2, n)))
    engine = Engine(
        model,
        SGD_MOMENTUM,
        lm_loss,
        device=EmulatedDevice(memory="8MB", h2d="1GB/s", d2h="1GB/s"),
        minibatch_size=8,
        plan=plan,
    )
    for x, y in data:
        engine.step(x, y)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        # the tied weight's gradients are summed per microbatch, as autograd sums them
        assert torch.equal(a, b), name
