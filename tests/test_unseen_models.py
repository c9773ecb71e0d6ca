"""The engine on architectures its other tests were not written around
(:mod:`unseen_models`): bitwise equal to the plain loop for every policy that
claims it, and device memory equal to the simulator's, every run."""

from __future__ import annotations

import copy

import pytest
import torch
from unseen_models import MODELS, batch, build, layers_of

import harmony
from harmony import EmulatedDevice, EmulatedServer, Engine, Plan, reference_step
from harmony.plan import uniform_packs
from harmony.simulate import simulate_graph

B, U = 8, 2
SGD = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)  # noqa: E731


def device(n: int, memory: str = "8MB"):
    return (
        EmulatedDevice(memory=memory, h2d="4GB/s", d2h="4GB/s")
        if n == 1
        else EmulatedServer(gpus=n, memory=memory, h2d="4GB/s", d2h="4GB/s", p2p="4GB/s")
    )


def plan(policy: str, n: int, L: int, pack: int) -> Plan:
    bwd = uniform_packs(0, L, pack)
    return Plan(policy, n, B, U, U, uniform_packs(0, bwd[-1][0], pack), bwd)


#: (policy, GPUs, layers per pack): every policy that claims bitwise exactness
EXACT = [
    ("harmony-pp", 1, 1),
    ("harmony-pp", 1, 2),
    ("harmony-pp", 2, 1),
    ("harmony-no-grouping", 1, 2),
    ("karma", 1, 2),
    ("hydra", 1, 1),
    ("zero-offload", 1, 1),
    ("gpipe-swap", 2, 1),
]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("policy, n, pack", EXACT)
def test_bitwise_equal_to_the_plain_loop(kind, policy, n, pack):
    loss = MODELS[kind][1]
    steps = [batch(kind, B, seed) for seed in (1, 2)]
    expected = build(kind)
    opt = SGD(list(expected.parameters()))
    ref_losses = [
        reference_step(list(harmony.decompose(expected)), loss, opt, x, y, U, step)
        for step, (x, y) in enumerate(steps)
    ]
    model = build(kind)
    engine = Engine(
        model,
        SGD,
        loss,
        device=device(n),
        minibatch_size=B,
        plan=plan(policy, n, layers_of(kind), pack),
    )
    losses = [engine.step(x, y) for x, y in steps]
    for (name, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    assert losses == ref_losses
    volume = harmony.swap_volume(engine.spec, engine.plan)
    moved = engine.trace.summary.bytes_by_kind
    for kind_, nbytes in volume.items():
        assert moved.get(kind_, 0.0) == pytest.approx(nbytes), kind_


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize(
    "policy, n, pack",
    [
        ("harmony-pp", 1, 1),
        ("harmony-pp", 1, 3),
        ("harmony-pp", 2, 2),
        ("harmony-no-grouping", 1, 2),
        ("harmony-dp", 2, 2),
    ],
)
def test_measured_peak_is_the_simulated_peak_every_run(kind, policy, n, pack):
    model = build(kind)
    engine = Engine(
        model,
        SGD,
        MODELS[kind][1],
        device=device(n),
        minibatch_size=B,
        plan=plan(policy, n, layers_of(kind), pack),
    )
    x, y = batch(kind, B)
    for _ in range(3):
        engine.step(x, y)
        s = engine.trace.summary
        simulated = simulate_graph(engine._graph_cache).summary.peak_memory
        for gpu, peak in s.peak_memory.items():
            assert peak == pytest.approx(simulated[gpu], rel=1e-9), gpu
            assert s.undeclared_bytes[gpu] == 0, (
                f"{gpu}: the spec undercounts what the engine holds"
            )
            assert 0 < s.held_peak_memory[gpu] <= peak


def test_a_parameter_shared_inside_one_layer_runs_on_a_second_gpu():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), Shared(), torch.nn.Linear(8, 3))

    x, y = torch.randn(B, 4), torch.randint(0, 3, (B,))
    expected = make()
    reference_step(
        list(expected),
        torch.nn.functional.cross_entropy,
        SGD(list(expected.parameters())),
        x,
        y,
        U,
        0,
    )
    model = make()
    engine = Engine(
        model,
        SGD,
        torch.nn.functional.cross_entropy,
        device=device(2),
        minibatch_size=B,
        plan=Plan("harmony-pp", 2, B, U, U, ((0, 1), (1, 2)), ((0, 1), (1, 2), (2, 3))),
    )
    engine.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))


def test_a_plain_list_of_layers_trains_and_rolls_back():
    layers = list(build("mlp"))
    before = copy.deepcopy(layers)
    engine = Engine(
        layers,
        SGD,
        torch.nn.functional.cross_entropy,
        device=device(1),
        minibatch_size=B,
        plan=plan("harmony-pp", 1, len(layers), 3),
    )
    (x,), y = batch("mlp", B)
    engine.step(x, y)
    assert not torch.equal(layers[0].weight, before[0].weight)
    trained = copy.deepcopy(layers)
    with pytest.raises(
        harmony.NonFiniteError
    ):  # a failed step leaves the list's weights as they were
        engine.step(torch.full_like(x, float("nan")), y)
    assert all(
        torch.equal(a, b)
        for m, n in zip(layers, trained)
        for a, b in zip(m.parameters(), n.parameters())
    )
    assert engine.model is layers
