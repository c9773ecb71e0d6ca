"""FlatAdamW steps like torch.optim.AdamW: bitwise in its exact mode, bitwise to
AdamW(fused=True) and allclose to the default in its fused mode."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import harmony.engine.optim
from harmony import Engine, FlatAdamW, HarmonyError, Plan, reference_step
from harmony.engine.optim import fused_kernel_available

# small blocks, so that small tensors span several (the arithmetic is the same at any size)
BLOCK = 1024
# tensors spanning blocks at odd offsets, small and odd-sized ones, matrices
SHAPES = [(7, 13), (3 * BLOCK + 99,), (3,), (129, 257), (5000, 3)]
HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
needs_fused = pytest.mark.skipif(
    not fused_kernel_available(), reason="this torch has no fused CPU AdamW kernel"
)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(harmony.engine.optim, "BLOCK", BLOCK)


def make_params(strided: bool = False, dtypes=None) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    if strided:  # a transposed parameter: not contiguous
        params[3] = torch.randn(257, 129, generator=g).t()
    if dtypes:
        params = [p.to(d) for p, d in zip(params, dtypes)]
    return [nn.Parameter(p) for p in params]


def train(
    make_optimizer, steps: int = 5, params=None, skip=((1, 2), (2, 2), (3, 0))
) -> list[torch.Tensor]:
    """``steps`` steps on fresh random gradients (a new .grad tensor every step);
    the (step, parameter) pairs in ``skip`` get no gradient."""
    params = params if params is not None else make_params()
    g = torch.Generator().manual_seed(1)
    opt = make_optimizer(params)
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (k, i) in skip else torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in params]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), (
            f"parameter {i} differs by up to {(x - y).abs().max().item():.3g}"
        )


@pytest.mark.parametrize("foreach", [False, True], ids=["default", "foreach"])
def test_exact_mode_is_bitwise_equal_to_torch_adamw(foreach):
    expected = train(lambda ps: torch.optim.AdamW(ps, foreach=foreach, **HYPER))
    assert_equal(train(lambda ps: FlatAdamW(ps, fused=False, **HYPER)), expected)


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_fused)], ids=["exact", "fused"]
)
def test_strided_and_mixed_dtype_parameters(fused):
    strided = lambda: make_params(strided=True)  # noqa: E731
    expected = train(lambda ps: torch.optim.AdamW(ps, **HYPER), params=strided())
    got = train(lambda ps: FlatAdamW(ps, fused=fused, **HYPER), params=strided())
    if fused:
        torch.testing.assert_close(got, expected)
    else:
        assert_equal(got, expected)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32, torch.float64]
    mixed = lambda: make_params(dtypes=dtypes)  # noqa: E731
    expected = train(
        lambda ps: torch.optim.AdamW(ps, fused=fused or None, **HYPER), params=mixed()
    )
    assert_equal(train(lambda ps: FlatAdamW(ps, fused=fused, **HYPER), params=mixed()), expected)


@needs_fused
def test_fused_mode_is_torch_fused_adamw_and_close_to_the_default():
    got = train(lambda ps: FlatAdamW(ps, **HYPER))
    assert_equal(got, train(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)))
    torch.testing.assert_close(
        got, train(lambda ps: torch.optim.AdamW(ps, **HYPER)), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    "fused", [False, pytest.param(None, marks=needs_fused)], ids=["exact", "fused"]
)
def test_parameters_without_gradient_are_skipped_and_keep_their_objects(fused):
    params = make_params()
    before = [(p, p.data_ptr(), p.detach().clone()) for p in params]
    opt = FlatAdamW(params, fused=fused, **HYPER)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert list(opt.state) == [params[0]] and opt.state[params[0]]["step"].item() == 1
    for i, (p, ptr, old) in enumerate(before):
        assert params[i] is p and p.data_ptr() == ptr
        assert torch.equal(p, old) == (i != 0)


def test_state_dict_round_trip_resumes_identically():
    def resume(first, then, save_at=3, steps=6):
        """Train ``steps`` steps, but rebuild parameters and optimizer from a
        saved checkpoint after ``save_at``."""
        params = make_params()
        g = torch.Generator().manual_seed(1)
        opt = first(params)
        for k in range(steps):
            if k == save_at:
                buf = io.BytesIO()
                torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf)
                params = [nn.Parameter(p.clone()) for p in saved["params"]]
                opt = then(params)
                opt.load_state_dict(saved["opt"])
            for i, p in enumerate(params):
                p.grad = None if (k, i) == (1, 2) else torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach() for p in params]

    flat = lambda ps: FlatAdamW(ps, fused=False, **HYPER)  # noqa: E731
    torch_adamw = lambda ps: torch.optim.AdamW(ps, **HYPER)  # noqa: E731
    expected = train(torch_adamw, steps=6, skip=((1, 2),))
    assert_equal(resume(flat, flat), expected)
    assert_equal(resume(flat, torch_adamw), expected)  # the state dict moves between the two
    assert_equal(resume(torch_adamw, flat), expected)


def test_load_state_dict_copies_into_the_flat_buffers():
    params = make_params()
    opt = FlatAdamW(params, fused=False, **HYPER)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    clone = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()},
        "param_groups": saved["param_groups"],
    }
    opt.step()
    opt.load_state_dict(clone)
    for i, p in enumerate(params):
        state = opt.state[p]
        assert torch.equal(state["exp_avg"], clone["state"][i]["exp_avg"])
        assert (
            state["exp_avg"].data_ptr() != clone["state"][i]["exp_avg"].data_ptr()
        )  # a view of the buffer
        assert state["step"] is not clone["state"][i]["step"] and state["step"].item() == 1
    with pytest.raises(HarmonyError, match="not an AdamW state"):
        sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        sgd.step()
        opt.load_state_dict(sgd.state_dict())


def test_learning_rate_changes_through_param_groups():
    def run(make):
        params = make_params()
        opt = make(params)
        g = torch.Generator().manual_seed(2)
        for k, lr in enumerate([1e-2, 3e-3, 0.0, 5e-2]):
            for group in opt.param_groups:
                group["lr"] = lr
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach() for p in params]

    assert_equal(
        run(
            lambda ps: FlatAdamW(
                [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], fused=False, **HYPER
            )
        ),
        run(
            lambda ps: torch.optim.AdamW(
                [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], **HYPER
            )
        ),
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(maximize=True), "maximize"),
        (dict(lr=-1.0), "invalid lr"),
        (dict(betas=(0.9, 1.0)), "invalid betas"),
        (dict(weight_decay=-0.1), "invalid weight_decay"),
        (dict(fused="yes"), "fused must be"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(HarmonyError, match=message):
        FlatAdamW(make_params(), **kwargs)


def test_unsupported_parameters_and_gradients_are_refused():
    with pytest.raises(HarmonyError, match="no parameters"):
        FlatAdamW([])
    with pytest.raises(HarmonyError, match="complex64"):
        FlatAdamW([nn.Parameter(torch.randn(3, dtype=torch.complex64))])
    p = nn.Parameter(torch.randn(4, 3))
    opt = FlatAdamW([p], fused=False)
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(HarmonyError, match="sparse"):
        opt.step()
    opt.param_groups[0]["amsgrad"] = True  # e.g. from a loaded torch.optim.AdamW state dict
    p.grad = torch.randn(4, 3)
    with pytest.raises(HarmonyError, match="amsgrad"):
        opt.step()


@pytest.mark.parametrize(
    "fused", [False, pytest.param(None, marks=needs_fused)], ids=["exact", "fused"]
)
def test_engine_with_flat_adamw_is_bitwise_equal_to_the_reference_loop(fused):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 5)
        )

    factory = lambda ps: FlatAdamW(ps, fused=fused, **HYPER)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(4)
    ]
    plan = Plan("harmony-pp", 1, 8, 4, 4, ((0, 2), (2, 4)), ((0, 2), (2, 4), (4, 5)))
    engine = Engine(model(), factory, nn.functional.cross_entropy, "cpu", 8, plan)
    assert all(isinstance(opt, FlatAdamW) for opt in engine.optimizers.values())
    expected = model()
    opt = factory(list(expected.parameters()))
    for step, (x, y) in enumerate(data):
        assert engine.step(x, y) == reference_step(
            list(expected), nn.functional.cross_entropy, opt, (x,), y, 4, step
        )
    assert_equal(list(engine.model.parameters()), [p.detach() for p in expected.parameters()])
