"""Shared fixtures and hypothesis strategies: small random models, servers and plans.

Everything generated here is small (2-12 layers, minibatch <= 16, <= 4 GPUs) so
one simulation takes milliseconds and property tests can afford many examples.
"""

from __future__ import annotations

import math
import os
import signal
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import strategies as st

import harmony

# harmony.workbench puts a stand-in for rfc3987_syntax: the test modules import nbformat,
# whose jsonschema would compile that module's grammar (2.3 s in every worker) for IRI
# format checks that no test makes first (harmony.workbench.deferred_imports)
import harmony.workbench  # noqa: F401
from harmony import Curve, Hardware, LayerCost, ModelSpec, Plan
from harmony.workbench import row_pool

POLICY_NAMES = tuple(sorted(harmony.POLICIES))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs in a worker per core (make test): one torch thread each, or the
    # workers' thread pools fight over the cores
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_rows_ahead(monkeypatch):
    """The explorers simulate no rows ahead of a change (their idle workers would take
    cores from the other tests); tests/test_explorer_updates.py turns it on where it
    tests it."""
    monkeypatch.setattr(row_pool, "AHEAD", False)


@pytest.fixture(autouse=True)
def _ctrl_c_is_left_as_found():
    """Every test leaves Python's Ctrl-C handler as it found it: one left changed (by
    the engine's point of no return, say, or a library a test drives) would swallow
    or redirect every later Ctrl-C in this process. The test that changed it fails,
    named, and the handler is put back for the tests after it."""
    before, os_before = signal.getsignal(signal.SIGINT), _sigint_at_os_level()
    yield
    after, os_after = signal.getsignal(signal.SIGINT), _sigint_at_os_level()
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"the test left the SIGINT handler changed: {before!r} -> {after!r}")
    if os_after != os_before:
        # Changed below Python (C code's own sigaction or mask: Python's table still shows
        # its handler), where the Ctrl-C tests once found SIGINT doing nothing in the
        # full suite. Put back, and named in the warnings summary, not failed: the test
        # did what its library does, and the tests after it get Ctrl-C as it was.
        signal.signal(signal.SIGINT, before)  # reinstalls it with sigaction
        if os_before[1] != os_after[1]:
            how = signal.SIG_BLOCK if os_before[1] else signal.SIG_UNBLOCK
            signal.pthread_sigmask(how, {signal.SIGINT})
        warnings.warn(
            f"the test changed SIGINT below Python: (ignored, blocked) {os_before} -> "
            f"{os_after}; put back",
            stacklevel=1,
        )


def _sigint_at_os_level() -> tuple[bool, bool]:
    """(ignored by the process, blocked in this thread), as the kernel has them."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        with open("/proc/self/status") as f:
            ignored_mask = next(line for line in f if line.startswith("SigIgn:")).split()[1]
    except (OSError, StopIteration):  # not Linux: what Python knows
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN, blocked
    return bool(int(ignored_mask, 16) >> (signal.SIGINT - 1) & 1), blocked


# ---- models -----------------------------------------------------------------------
# Strategies are built once, here: hypothesis validates every strategy object on its
# first draw, and building them inside the composites below made that validation most
# of the properties' time (53 of 61 s in a profile of two of them).
def _linear_curve(per_sample_max: float, fixed_max: float):
    """A line through (0, fixed) with a non-negative slope; zero sometimes, to
    exercise zero-length tasks and zero-byte buffers."""
    return st.builds(
        Curve.linear,
        st.one_of(st.just(0.0), st.floats(per_sample_max * 1e-3, per_sample_max)),
        st.one_of(st.just(0.0), st.floats(0.0, fixed_max)),
    )


def _zero_or_up_to(most: int):
    return st.one_of(st.just(0), st.integers(1, most))


_PARAM_NUMEL, _BUFFER_NUMEL, _FIXED_BYTES = (
    _zero_or_up_to(2_000_000),
    _zero_or_up_to(5_000),
    _zero_or_up_to(4096),
)
_INPUT_NUMEL = st.integers(0, 200_000)
_FWD_FLOPS, _BWD_FLOPS = st.floats(0.0, 1e10), st.floats(0.0, 3e10)
_FWD_TIME, _BWD_TIME = _linear_curve(5e-3, 1e-3), _linear_curve(1.5e-2, 3e-3)
_FWD_EXTRA, _BWD_EXTRA = _linear_curve(4e6, 1e6), _linear_curve(1.2e7, 3e6)
_UPDATE_TIME = st.one_of(st.none(), st.floats(0.0, 0.05))


@st.composite
def layer_costs(draw) -> LayerCost:
    """A random layer, named ``layer0`` (:func:`model_specs` names each by its place)."""
    measured_times = draw(st.booleans())
    return LayerCost(
        name="layer0",
        param_numel=draw(_PARAM_NUMEL),
        buffer_numel=draw(_BUFFER_NUMEL),
        input_numel_per_sample=float(draw(_INPUT_NUMEL)),
        input_fixed_bytes_per_sample=float(draw(_FIXED_BYTES)),
        # without measured curves the times come from FLOPs and the GPU's FLOP rate
        fwd_flops_per_sample=draw(_FWD_FLOPS),
        bwd_flops_per_sample=draw(_BWD_FLOPS),
        fwd_time=draw(_FWD_TIME) if measured_times else None,
        bwd_time=draw(_BWD_TIME) if measured_times else None,
        fwd_extra=draw(_FWD_EXTRA),
        bwd_extra=draw(_BWD_EXTRA),
        update_time_s=draw(_UPDATE_TIME),
    )


_LAYER = layer_costs()
_OPTIMIZER = st.sampled_from(["sgd", "sgd-momentum", "adam", "adamw"])
_PARAM_DTYPE = st.sampled_from(["float32", "float16", "bfloat16"])
_ACT_DTYPE = st.sampled_from(["float32", "bfloat16"])
_TARGET_BYTES = st.integers(0, 4096)


@st.composite
def model_specs(draw, min_layers: int = 2, max_layers: int = 12) -> ModelSpec:
    n = draw(st.integers(min_layers, max_layers))
    return ModelSpec(
        name=f"random-{n}",
        layers=tuple(replace(draw(_LAYER), name=f"layer{i}") for i in range(n)),
        optimizer=draw(_OPTIMIZER),
        param_dtype=draw(_PARAM_DTYPE),
        act_dtype=draw(_ACT_DTYPE),
        target_bytes_per_sample=float(draw(_TARGET_BYTES)),
    )


# ---- servers ----------------------------------------------------------------------
_RATE = st.floats(1e8, 5e10)


@st.composite
def hardwares(draw, min_gpus: int = 1, max_gpus: int = 4, memory=None) -> Hardware:
    return Hardware(
        name="random",
        n_gpus=draw(st.integers(min_gpus, max_gpus)),
        gpu_memory=draw(memory if memory is not None else st.just(10**15)),
        gpu_flops=draw(st.floats(1e11, 1e14)),
        h2d=draw(_RATE),
        d2h=draw(_RATE),
        uplink=draw(_RATE),
        gpus_per_switch=draw(st.integers(1, 4)),
        p2p=draw(st.one_of(st.none(), _RATE)),
        cpu_update_bandwidth=draw(st.floats(1e9, 1e11)),
        cpu_update_workers=draw(st.integers(1, 4)),
        host_memory=10**13,
        gpu_update_bandwidth=draw(st.floats(1e10, 1e13)),
    )


# ---- plans ------------------------------------------------------------------------
@st.composite
def contiguous_packs(draw, start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """Random contiguous (start, stop) packs covering [start, stop); () if empty."""
    if stop <= start:
        return ()
    cuts = sorted(
        draw(st.sets(st.integers(start + 1, stop - 1), max_size=stop - start - 1))
        if stop - start > 1
        else set()
    )
    bounds = [start, *cuts, stop]
    return tuple(zip(bounds[:-1], bounds[1:]))


@st.composite
def plans(
    draw, policy: str, num_layers: int, max_gpus: int, max_minibatch: int = 16, minibatch=None
) -> Plan:
    bwd = draw(contiguous_packs(0, num_layers))
    fwd = draw(contiguous_packs(0, bwd[-1][0]))
    B = draw(minibatch if minibatch is not None else st.integers(1, max_minibatch))
    uf = draw(st.integers(1, B))  # need not divide the minibatch
    ub = uf if harmony.policies.get_policy(policy).PER_MICROBATCH else draw(st.integers(1, B))
    options = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries(
                {"offload_activations": st.booleans(), "prefetch_packs": st.integers(1, 3)}
            ),
        )
    )
    return fit_to_policy(
        Plan(policy, draw(st.integers(1, max_gpus)), B, uf, ub, fwd, bwd, options)
    )


def fit_to_policy(plan: Plan) -> Plan:
    """``plan`` made acceptable to its policy: hydra runs on one GPU, gpipe-swap
    needs a backward pack (stage) per GPU, zero-offload the same number of
    microbatches on every GPU (a minibatch divisible by the GPUs),
    model-parallel a pack per GPU, forward on the backward packs and one
    microbatch size, resident one GPU, one pack and one microbatch size."""
    if plan.policy == "resident":
        every = ((0, plan.bwd_packs[-1][1]),)
        return replace(
            plan, n_gpus=1, fwd_packs=(), bwd_packs=every, bwd_microbatch=plan.fwd_microbatch
        )
    if plan.policy == "hydra":
        return replace(plan, n_gpus=1)
    if plan.policy == "gpipe-swap":
        return replace(plan, n_gpus=min(plan.n_gpus, len(plan.bwd_packs)))
    if plan.policy == "zero-offload":
        return replace(plan, minibatch=-(-plan.minibatch // plan.n_gpus) * plan.n_gpus)
    if plan.policy == "model-parallel":
        return replace(
            plan,
            n_gpus=min(plan.n_gpus, len(plan.bwd_packs)),
            fwd_packs=plan.bwd_packs[:-1],
            bwd_microbatch=plan.fwd_microbatch,
        )
    return plan


@st.composite
def scenarios(draw, policies=POLICY_NAMES, memory=None):
    """(spec, hardware, plan) with a valid plan of a random policy."""
    spec = draw(model_specs())
    hw = draw(hardwares(memory=memory))
    policy = draw(st.sampled_from(policies))
    plan = draw(plans(policy, len(spec), hw.n_gpus))
    return spec, hw, plan


# ---- fixtures -----------------------------------------------------------------------
def tiny_spec(
    n_layers: int = 2,
    *,
    params: int = 1_000_000,
    act: float = 250_000.0,
    fwd_s: float = 1e-3,
    bwd_s: float = 3e-3,
    update_s: float = 0.01,
    target: float = 8.0,
    optimizer: str = "adamw",
) -> ModelSpec:
    """A chain of identical layers with simple, hand-computable costs
    (times per sample, fixed working memory)."""
    layer = lambda i: LayerCost(  # noqa: E731
        name=f"l{i}",
        param_numel=params,
        input_numel_per_sample=act,
        fwd_time=Curve.linear(fwd_s),
        bwd_time=Curve.linear(bwd_s),
        fwd_extra=Curve.linear(0.0, 1e6),
        bwd_extra=Curve.linear(0.0, 2e6),
        update_time_s=update_s,
    )
    return ModelSpec(
        "tiny",
        tuple(layer(i) for i in range(n_layers)),
        optimizer=optimizer,
        target_bytes_per_sample=target,
    )


def simple_hardware(
    n_gpus: int = 1,
    *,
    link: float = 1e9,
    uplink: float | None = None,
    p2p: float | None = 2e9,
    memory: int = 10**12,
    gpus_per_switch: int | None = None,
    workers: int = 4,
) -> Hardware:
    """Every host link at ``link`` bytes/s, uplink as fast unless given."""
    return Hardware(
        name=f"simple-{n_gpus}",
        n_gpus=n_gpus,
        gpu_memory=memory,
        gpu_flops=1e12,
        h2d=link,
        d2h=link,
        uplink=link if uplink is None else uplink,
        gpus_per_switch=gpus_per_switch or n_gpus,
        p2p=p2p,
        cpu_update_bandwidth=1e10,
        cpu_update_workers=workers,
        host_memory=10**13,
    )


@pytest.fixture
def tiny():
    return tiny_spec()


def close(a: float, b: float, rel: float = 1e-9, abs_: float = 1e-12) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``path`` -> :class:`executed.Executed`: the notebook run once this session with
    its smoke parameters (see :mod:`executed`)."""
    from executed import execute_once, shared_directory
    from test_notebooks import smoke_parameters

    root = shared_directory(tmp_path_factory)
    return lambda path: execute_once(path, smoke_parameters(path), root)
