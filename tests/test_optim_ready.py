"""Which optimizers' next step cannot fail (the point of no return's question,
harmony.engine.optim_ready): torch's Adam, AdamW and SGD once their state
exists, as torch steps host tensors; anything that runs code of the caller's, or
whose state or hyperparameters are not what its arithmetic expects, is not sure."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from harmony import FlatAdamW
from harmony.engine.optim_ready import ready_to_step

#: the optimizers the point of no return passes for, once stepped
SURE = {
    "FlatAdamW": lambda ps: FlatAdamW(ps, lr=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "Adam-foreach-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, amsgrad=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def stepped(factory, steps: int = 1) -> torch.optim.Optimizer:
    """An optimizer of ``factory`` over a small layer, stepped ``steps`` times, a
    gradient in place for its next step."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    opt = factory(list(layer.parameters()))
    for _ in range(steps + 1):
        opt.zero_grad()
        layer(torch.randn(2, 4)).square().sum().backward()
        if _ < steps:
            opt.step()
    return opt


@pytest.mark.parametrize("name", SURE)
def test_a_stepped_optimizer_is_ready_and_a_fresh_one_is_not(name):
    assert ready_to_step(stepped(SURE[name]))
    if name != "FlatAdamW":  # FlatAdamW: its own method, tested with it
        assert not ready_to_step(stepped(SURE[name], steps=0))  # its step makes state


def test_sgd_without_momentum_keeps_no_state_and_is_ready_at_once():
    assert ready_to_step(stepped(lambda ps: torch.optim.SGD(ps, lr=0.1), steps=0))


def test_code_of_the_callers_in_the_step_makes_it_unsure():
    opt = stepped(SURE["AdamW"])
    handle = opt.register_step_pre_hook(lambda *_: None)
    assert not ready_to_step(opt)
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert not ready_to_step(opt)
    finally:
        handle.remove()
    assert ready_to_step(opt)
    opt.step = lambda closure=None: None
    assert not ready_to_step(opt)


def test_a_subclass_may_step_otherwise():
    class Mine(torch.optim.AdamW):
        pass

    assert not ready_to_step(stepped(Mine))


@pytest.mark.parametrize(
    "change",
    [
        lambda group: group.update(lr=torch.tensor(0.01)),
        lambda group: group.update(eps="1e-8"),
        lambda group: group.update(betas=(0.9,)),
        lambda group: group.update(capturable=True),
        lambda group: group.update(differentiable=True),
        lambda group: group.update(amsgrad=True),  # no max_exp_avg_sq to update
    ],
    ids=["tensor-lr", "string-eps", "one-beta", "capturable", "differentiable", "amsgrad-late"],
)
def test_hyperparameters_its_arithmetic_does_not_expect_make_it_unsure(change):
    opt = stepped(SURE["AdamW"])
    change(opt.param_groups[0])
    assert not ready_to_step(opt)


@pytest.mark.parametrize(
    "change",
    [
        lambda p, state: state.update(exp_avg=torch.zeros(7)),
        lambda p, state: state.update(exp_avg_sq=state["exp_avg_sq"].double()),
        lambda p, state: state.pop("step"),
        lambda p, state: setattr(p, "grad", p.grad.to_sparse()),
    ],
    ids=["moment-shape", "moment-dtype", "no-step", "sparse-gradient"],
)
def test_a_state_or_gradient_unlike_its_parameter_makes_it_unsure(change):
    opt = stepped(SURE["AdamW"])
    p = opt.param_groups[0]["params"][0]
    change(p, opt.state[p])
    assert not ready_to_step(opt)
