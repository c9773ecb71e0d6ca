"""Reused memory and merged copies: the steady-state step allocates no new host
buffers, an emulated GPU's copies live no longer than the graph holds them, a
pack's weights cross in one copy, and reuse never lets a value be overwritten
while a buffer still holds it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from harmony import EmulatedDevice, EmulatedServer, Engine, Plan, reference_step
from harmony.engine.buffers import BufferPool, HostLayout, copy_runs
from harmony.engine.step import compute as compute_module

B = 12
LOSS = nn.functional.cross_entropy
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731


def make_model() -> nn.Sequential:
    """Identity layers make a pack's output (or a stash) the very tensor that
    came in: a buffer copied in from the host is then held by two graph buffers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.Identity(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Identity(),
        nn.Linear(32, 32),
        nn.Identity(),
        nn.Linear(32, 5),
    )


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)) for _ in range(n)
    ]


DEVICE = EmulatedDevice(memory="4MB", h2d="1GB/s", d2h="1GB/s")
# plan, device: each moves weights, gradients and inputs; most stash or offload through the host
CASES = {
    "harmony-pp": (
        Plan("harmony-pp", 1, B, 4, 4, ((0, 2), (2, 5)), ((0, 2), (2, 5), (5, 9))),
        DEVICE,
    ),
    "harmony-no-grouping": (
        Plan("harmony-no-grouping", 1, B, 4, 4, ((0, 5),), ((0, 5), (5, 9))),
        DEVICE,
    ),
    "hydra": (Plan("hydra", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 9))), DEVICE),
    "harmony-dp": (
        Plan("harmony-dp", 2, B, 2, 2, ((0, 5),), ((0, 5), (5, 9))),
        EmulatedServer(gpus=2, memory="4MB", h2d="1GB/s", d2h="1GB/s", p2p="1GB/s"),
    ),
    "gpipe-swap": (
        Plan("gpipe-swap", 2, B, 3, 3, ((0, 2), (2, 6)), ((0, 2), (2, 6), (6, 9))),
        EmulatedServer(gpus=2, memory="4MB", h2d="1GB/s", d2h="1GB/s", p2p="1GB/s"),
    ),
}


class WeightAddresses:
    """Where each layer's weights are when it computes (forward pre-hooks see the
    tensors the engine swapped in)."""

    def __init__(self, model: nn.Module):
        self.seen: set[int] = set()
        for layer in model:
            layer.register_forward_pre_hook(self.record)

    def record(self, module, args):
        self.seen.update(
            getattr(module, name).data_ptr() for name, _ in module.named_parameters(recurse=False)
        )


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that notes where the gradients it steps with live."""

    def step(self, closure=None):
        self.grad_addresses = [
            p.grad.data_ptr() for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        return super().step(closure)


class DeviceCopies:
    """The buffers an engine's emulated GPUs copy into: how many bytes of them are
    alive (some view of them still held) now and at most, as each is made."""

    def __init__(self, engine: Engine):
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.most = 0
        for backend in engine.backends:
            backend.buffer = self.recorded(backend.buffer)

    def recorded(self, make):
        def buffer(numel, dtype):
            t = make(numel, dtype)
            self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
            self.live.append((StorageWeakRef(t.untyped_storage()), numel * dtype.itemsize))
            self.most = max(self.most, self.alive())
            return t

        return buffer

    def alive(self) -> int:
        return sum(n for ref, n in self.live if not ref.expired())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_steady_state_step_allocates_no_new_buffers(case, precision):
    """On the host: buffers kept from step to step. On an emulated GPU (host memory
    too): copies in memory of their own, alive only while the graph holds them, so
    no more of them at once than the device's capacity and none after a step."""
    plan, device = CASES[case]
    model = make_model()
    engine = Engine(
        model,
        lambda ps: RecordingAdamW(ps, lr=1e-2),
        LOSS,
        device=device,
        minibatch_size=B,
        plan=plan,
        precision=precision,
    )
    host = {p.data_ptr() for p in model.parameters()}
    addresses = WeightAddresses(model)
    copies = DeviceCopies(engine)
    data = batches(4)
    engine.step(*data[0])
    first = engine.trace.summary
    # the host pools and gradient buffers made at least the host gradients
    weights = sum(p.numel() for p in model.parameters())
    assert first.new_buffers > 0 and first.new_buffer_bytes >= weights * 4
    engine.step(*data[1])
    addresses.seen = set()
    grads = []
    for x, y in data[2:]:
        engine.step(x, y)
        assert (engine.trace.summary.new_buffers, engine.trace.summary.new_buffer_bytes) == (0, 0)
        # the layers computed on copies of the weights, none of them left after the step
        assert addresses.seen and not addresses.seen & host
        assert copies.alive() == 0
        grads.append(
            {key: opt.grad_addresses for key, opt in engine.optimizers.items() if opt is not None}
        )
    assert grads[0] == grads[1]  # gradients land in the same host buffers every step
    assert all(engine.host.layout.has_grad_buffer(p) for p in model.parameters())
    capacity = sum(b.ledger.capacity for b in engine.backends)
    assert 0 < copies.most <= capacity


def test_pooled_buffers_are_reused_only_when_no_graph_buffer_holds_them():
    """Bitwise equal to the plain loop with identity layers at pack edges, where
    a copied-in buffer is also the next pack's input, a stash or an output."""
    data = batches(3)
    for case, (plan, device) in CASES.items():
        if plan.policy == "harmony-dp":
            continue  # data parallel sums gradients in another order: allclose, tested elsewhere
        reference_model = make_model()
        opt = ADAMW(list(reference_model.parameters()))
        expected = [
            reference_step(list(reference_model), LOSS, opt, (x,), y, plan.fwd_microbatch, s)
            for s, (x, y) in enumerate(data)
        ]
        engine = Engine(make_model(), ADAMW, LOSS, device=device, minibatch_size=B, plan=plan)
        losses = [engine.step(x, y) for x, y in data]
        assert losses == expected, case
        for a, b in zip(engine.model.parameters(), reference_model.parameters()):
            assert torch.equal(a, b), case


def test_on_the_cpu_backend_the_gradient_autograd_made_is_the_host_grad():
    """Where the device computes on host memory, a pack's gradient becomes the host
    parameter's ``.grad`` as autograd made it: no host gradient buffer is made and
    nothing is copied into one, and the steps stay bitwise the plain loop's."""
    plan = CASES["harmony-pp"][0]
    data = batches(3)
    reference_model = make_model()
    opt = ADAMW(list(reference_model.parameters()))
    expected = [
        reference_step(list(reference_model), LOSS, opt, (x,), y, plan.fwd_microbatch, s)
        for s, (x, y) in enumerate(data)
    ]
    engine = Engine(make_model(), ADAMW, LOSS, device="cpu", minibatch_size=B, plan=plan)
    assert [engine.step(x, y) for x, y in data] == expected
    for a, b in zip(engine.model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)
    assert not any(engine.host.layout.has_grad_buffer(p) for p in engine.model.parameters())


def test_only_a_device_that_measures_what_tasks_hold_hooks_what_autograd_saves(monkeypatch):
    """The cpu backend measures no task's bytes beyond its buffers: no saved-tensor hook
    (a cost the plain loop does not pay), and its trace says the figures are not there;
    an emulated device measures them."""
    hooks = []
    saved_bytes = compute_module.SavedBytes

    def counted(*args, **kw):
        hooks.append(saved_bytes(*args, **kw))
        return hooks[-1]

    monkeypatch.setattr(compute_module, "SavedBytes", counted)
    plan = CASES["harmony-pp"][0]
    ((x, y),) = batches(1)
    cpu = Engine(make_model(), ADAMW, LOSS, device="cpu", minibatch_size=B, plan=plan)
    cpu.step(x, y)
    s = cpu.trace.summary
    assert not hooks
    assert s.undeclared_bytes is s.unheld_work_bytes is s.held_peak_memory is None
    emulated = Engine(make_model(), ADAMW, LOSS, device=DEVICE, minibatch_size=B, plan=plan)
    emulated.step(x, y)
    s = emulated.trace.summary
    assert hooks and all(h.total > 0 for h in hooks)
    assert s.undeclared_bytes == {"gpu0": 0.0} and s.held_peak_memory["gpu0"] > 0


def test_host_weights_are_flat_per_dtype_in_layer_order_and_keep_their_values():
    model = make_model()
    model[1].register_buffer("steps", torch.zeros((), dtype=torch.int64))
    values = {name: t.detach().clone() for name, t in model.state_dict().items()}
    HostLayout(list(model))
    params = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    offsets = [p.storage_offset() for p in params]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(torch.equal(t, values[name]) for name, t in model.state_dict().items())
    # a pack (any range of layers) crosses in one copy; buffers of another dtype apart
    host = [p.detach() for layer in model[3:7] for p in layer.parameters()]
    device = torch.empty(sum(t.numel() for t in host))
    pieces, o = [], 0
    for t in host:
        pieces.append((device[o : o + t.numel()], t))
        o += t.numel()
    ((dst, src),) = copy_runs(pieces)
    dst.copy_(src)
    assert torch.equal(device, torch.cat([t.reshape(-1) for t in host]))


def test_copy_runs_merge_only_what_is_adjacent_on_both_sides():
    src, dst = torch.arange(10.0), torch.zeros(10)
    runs = copy_runs(
        [
            (dst[0:2], src[0:2]),
            (dst[2:5], src[2:5]),  # merged
            (dst[5:7], src[6:8]),  # source not adjacent
            (dst[8:10], src[8:10]),  # destination not adjacent
        ]
    )
    assert [(d.numel(), s.numel()) for d, s in runs] == [(5, 5), (2, 2), (2, 2)]
    transposed = torch.arange(6.0).view(2, 3).t()
    ((d, s),) = copy_runs([(torch.zeros(6), transposed)])  # not contiguous: copied in its shape
    d.copy_(s)
    assert torch.equal(d, transposed)


def test_a_pool_hands_out_what_it_was_given_back_and_counts_only_new_tensors():
    pool = BufferPool()
    a = pool.take(100, torch.float32)
    pool.give(a)
    assert pool.take(100, torch.float32) is a
    pool.take(100, torch.bfloat16)
    assert (pool.allocations, pool.allocated_bytes) == (2, 600)
    pool.give(a)
    pool.clear()
    assert pool.held_bytes() == 0 and pool.take(100, torch.float32) is not a
