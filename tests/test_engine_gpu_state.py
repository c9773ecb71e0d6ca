"""The engine runs the swapping baselines with their training state on the GPUs
(the plan options ``gpu_gradients`` and ``gpu_optimizer``): gradient sums
swapped in and out per microbatch and all-reduced across replicas, the
optimizer stepped on each GPU between its state coming in and going out.
Weights train bitwise like the plain loop, each kind of transfer moves its
closed-form bytes, and the device memory peak is the simulated one."""

from __future__ import annotations

import pytest
import torch
from test_engine import ADAMW, B, batches, loss_fn, make_model, reference, train

import harmony
from harmony import EmulatedDevice, EmulatedServer, Engine, FlatAdamW, HarmonyError, Plan
from harmony.engine.step.updates import PackCommits, PackState, Updates
from harmony.graph import G_IN, OPT_IN, OPT_OUT, REDUCE
from harmony.policies.common import microbatches, replica_shares

ONE = tuple((i, i + 1) for i in range(9))  # a pack per layer, as vDNN swaps
THREE = ((0, 3), (3, 6), (6, 9))
OPTIONS = {
    "host": {},
    "gradients": {"gpu_gradients": True},
    "optimizer": {"gpu_optimizer": True},
    "both": {"gpu_gradients": True, "gpu_optimizer": True},
}


def device(n: int):
    if n == 1:
        return EmulatedDevice(memory="4MB", h2d="400MB/s", d2h="400MB/s")
    return EmulatedServer(gpus=n, memory="4MB", h2d="400MB/s", d2h="400MB/s", p2p="400MB/s")


def check_bytes_and_memory(engine: Engine) -> dict:
    """Bytes by kind measured == closed form == simulated; peaks as simulated. The
    last step's: the first moves no optimizer state in (there is none yet)."""
    measured, simulated = engine.trace.summary, engine.simulate().summary
    closed = harmony.swap_volume(engine.spec, engine.plan)
    for kind in set(closed) | set(measured.bytes_by_kind):
        want = closed.get(kind, 0.0)
        assert measured.bytes_by_kind.get(kind, 0.0) == pytest.approx(want, rel=1e-9), kind
        assert simulated.bytes_by_kind.get(kind, 0.0) == pytest.approx(want, rel=1e-9), kind
    assert measured.peak_memory == simulated.peak_memory
    assert all(v == 0 for v in measured.undeclared_bytes.values())
    return closed


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize(
    "policy, n, fwd, bwd",
    [
        ("layer-swap", 1, ONE[:-1], ONE),
        ("gpipe-swap", 1, ONE[:6], THREE),
        ("gpipe-swap", 2, ONE[:6], THREE),
    ],
)
def test_state_on_the_gpus_trains_bitwise_like_the_plain_loop(policy, n, fwd, bwd, options):
    data = batches(3)
    # with dropout and BatchNorm
    expected, ref_losses = reference(ADAMW, data, microbatch=4)
    engine, losses = train(Plan(policy, n, B, 4, 4, fwd, bwd, options), ADAMW, data, device(n))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.buffers(), expected.buffers()))
    assert losses == ref_losses
    closed = check_bytes_and_memory(engine)
    on_gpu = options.get("gpu_optimizer", False)
    assert (closed[OPT_IN] > 0) == on_gpu and (closed[G_IN] > 0) == ("gpu_gradients" in options)
    if on_gpu:  # weights, gradients and Adam's two moments in: charged to the device
        spec, states = engine.spec, [t for t in engine._graph_cache.tasks if t.kind == OPT_IN]
        for t in states:
            params = spec.grad_bytes(*t.layers)
            assert t.nbytes == 2 * params + spec.optimizer_state_bytes(*t.layers) == 4 * params
        largest = max(t.nbytes for t in states)
        assert max(engine.trace.summary.peak_memory.values()) >= largest > 0


def replicas_reference(data: list, n: int, microbatch: int) -> torch.nn.Module:
    """Data parallel as each replica sums its gradient and an all-reduce sums those
    in replica order, then one step: what the GPUs' gradient sums compute."""
    model = make_model(0.0, batchnorm=False)
    opt = ADAMW(list(model.parameters()))
    for x, y in data:
        total = None
        for share in replica_shares(B, n):
            for a, b in microbatches(share, microbatch):
                (loss_fn(model(x[a:b]), y[a:b]) * ((b - a) / B)).backward()
            mine = [p.grad for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            total = mine if total is None else [t + g for t, g in zip(total, mine)]
        for p, g in zip(model.parameters(), total):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_data_parallel_layer_swap_with_state_on_the_gpus(options):
    data, n = batches(3), 2
    plan = Plan("layer-swap", n, B, 2, 2, ONE[:-1], ONE, options)
    engine, _ = train(plan, ADAMW, data, device(n), dropout=0.0, batchnorm=False)
    if options.get("gpu_gradients"):  # summed on the GPUs, then across them in GPU order
        expected = replicas_reference(data, n, 2)
        assert all(
            torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters())
        )
    else:  # each microbatch's gradient added on the host as it arrives, from either GPU
        model = make_model(0.0, batchnorm=False)
        opt = ADAMW(list(model.parameters()))
        split = [m for share in replica_shares(B, n) for m in microbatches(share, 2)]
        for step, (x, y) in enumerate(data):
            harmony.reference_step(
                list(model), loss_fn, opt, (x,), y, None, step, microbatches=split
            )
        for a, b in zip(engine.model.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    closed = check_bytes_and_memory(engine)
    if options.get("gpu_gradients"):
        assert closed[REDUCE] > 0
    if options.get("gpu_optimizer"):  # every replica steps every pack
        assert closed[OPT_OUT] == n * sum(p.numel() * 4 * 3 for p in engine.model.parameters())


def test_flat_adamw_steps_on_an_emulated_gpu_as_on_the_host():
    data = batches(2)
    factory = lambda ps: FlatAdamW(ps, fused=False, lr=1e-2)  # noqa: E731
    expected, ref_losses = reference(factory, data, microbatch=4)
    plan = Plan("layer-swap", 1, B, 4, 4, ONE[:-1], ONE, OPTIONS["both"])
    engine, losses = train(plan, factory, data, device(1))
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    assert losses == ref_losses


def test_a_failed_step_undoes_the_updates_the_gpus_made(monkeypatch):
    plan = Plan("layer-swap", 1, B, 4, 4, ONE[:-1], ONE, OPTIONS["both"])
    engine, _ = train(plan, ADAMW, batches(1), device(1))
    before = [p.detach().clone() for p in engine.model.parameters()]
    state = engine.state_dict()["optimizer"]["state"]
    moments = {name: {k: v.clone() for k, v in s.items()} for name, s in state.items()}
    step = Updates.device_update

    # Packs step in model order, and a pack's state comes in once the state two packs
    # back has gone out: when the last pack steps, the host copies of most are written.
    def fail_last(self, task):
        if task.pack == len(ONE) - 1:
            raise RuntimeError("injected")
        step(self, task)

    x, y = batches(2)[1]
    with monkeypatch.context() as patch:
        patch.setattr(Updates, "device_update", fail_last)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), before))
    state = engine.state_dict()["optimizer"]["state"]
    assert all(torch.equal(v, moments[name][k]) for name, s in state.items() for k, v in s.items())
    assert all(b.ledger.in_use == 0 and b.ledger.held == 0 for b in engine.backends)
    engine.step(x, y)  # and trains on
    check_bytes_and_memory(engine)


def test_a_host_copy_is_written_once_every_replica_has_read_it():
    class Graph:  # two replicas step pack 0
        tasks = [type("T", (), {"kind": OPT_IN, "pack": 0})() for _ in range(2)]

    result = PackState([torch.zeros(1)], [{}])
    commits = PackCommits(Graph())
    assert commits.read(0) is None
    # the first replica is done before the second has read: the write waits for it
    assert commits.stepped(0, 0, result) is None
    assert commits.read(0) is result
    commits = PackCommits(Graph())
    assert commits.read(0) is None and commits.read(0) is None
    assert commits.stepped(0, 1, result) is None  # a replica but the first writes nothing
    assert commits.stepped(0, 0, result) is result


def test_what_the_engine_cannot_run_with_state_on_the_gpus_is_refused_in_words():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    mixed = Plan("layer-swap", 1, B, 4, 4, ONE[:-1], ONE, OPTIONS["optimizer"])
    with pytest.raises(HarmonyError, match="gpu_optimizer steps float32 parameters"):
        Engine(model, ADAMW, loss_fn, device(1), B, mixed, precision="bf16")
    resident = Plan("model-parallel", 1, B, 4, 4, (), ((0, 9),), OPTIONS["optimizer"])
    engine = Engine(model, ADAMW, loss_fn, device(1), B, resident)
    with pytest.raises(HarmonyError, match="resident on the GPUs, and the engine keeps them"):
        engine.step(*batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def tied_model() -> torch.nn.Sequential:
    """Layers 0 and 2 share their weight matrix."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    b.weight = a.weight
    return torch.nn.Sequential(a, torch.nn.ReLU(), b, torch.nn.ReLU(), torch.nn.Linear(16, 5))


@pytest.mark.parametrize("options", ["gradients", "optimizer", "both"])
def test_weights_tied_across_packs_step_once_every_part_of_their_gradient_is_in(options):
    """gradients: the tied parts sum on the host beside the GPUs' sums; optimizer: the
    pack of a tied weight's first layer takes its state in (OPT_IN) only after the
    other packs' parts of its gradient are in, so it steps the whole gradient."""
    packs = tuple((i, i + 1) for i in range(5))
    plan = Plan("layer-swap", 1, 8, 4, 4, packs[:-1], packs, OPTIONS[options])
    engine = Engine(tied_model(), ADAMW, loss_fn, device(1), 8, plan)
    expected = tied_model()
    opt = ADAMW(list(expected.parameters()))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        ref = harmony.reference_step(list(expected), loss_fn, opt, (x,), y, 4, step)
        assert engine.step(x, y) == ref
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), expected.parameters()))
    check_bytes_and_memory(engine)
