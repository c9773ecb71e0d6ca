"""Several models on one server (HYDRA's model selection): the schedules as one
task graph, simulated, and trained for real on an emulated server."""

from __future__ import annotations

import pytest
import torch
from conftest import simple_hardware, tiny_spec
from torch import nn

import harmony
from harmony import (
    Curve,
    EmulatedServer,
    Engine,
    HarmonyError,
    Job,
    LayerCost,
    ModelSpec,
    OutOfMemoryError,
    Plan,
)
from harmony.graph import IN_ORDER_KINDS
from harmony.planner.multi_model import SCHEDULES, schedule_many


def one_gpu_plan(
    n_layers: int, policy: str = "harmony-pp", minibatch: int = 16, microbatch: int = 4
) -> Plan:
    """One layer per pack."""
    packs = tuple((i, i + 1) for i in range(n_layers))
    return Plan(policy, 1, minibatch, microbatch, microbatch, packs[:-1], packs)


def unequal_jobs(steps: int = 2) -> list[Job]:
    """Three models of unequal size: more work than fits evenly on two GPUs as whole models."""
    return [
        Job(tiny_spec(n, params=p, act=10_000.0), one_gpu_plan(n), steps=steps, name=f"{n} layers")
        for n, p in ((6, 3_000_000), (4, 4_000_000), (3, 2_000_000))
    ]


def compute_order(graph, ids) -> list[tuple]:
    return [(graph.tasks[i].kind, graph.tasks[i].pack, graph.tasks[i].microbatch) for i in ids]


# ---- the merged graph ----------------------------------------------------------------------
def test_merged_graph_is_valid_plays_through_and_keeps_each_models_order():
    jobs = unequal_jobs()
    hw = simple_hardware(2, link=2e9)
    sched = schedule_many(jobs, hw, "merged")
    sched.graph.check()
    trace = harmony.simulate_graph(sched.graph)  # a deadlock would raise
    tl = trace.timeline
    assert sorted(tl.model.unique()) == [0, 1, 2]
    assert set(tl.lane) >= {"gpu0.compute", "gpu1.compute", "gpu0.h2d", "gpu1.h2d"}
    updates = tl[tl.kind == "UPD"]
    assert set(updates.lane) <= {f"cpu{w}" for w in range(hw.cpu_update_workers)}
    assert (
        updates.groupby("lane").model.nunique() > 1
    ).any()  # the models share the CPU update lanes
    units = sched.units()
    assert (units.groupby("model").gpu.nunique() == 2).any()  # some model moves between GPUs
    for m, job in enumerate(jobs):
        alone = harmony.build_graph(job.spec, hw, job.plan)
        expected = compute_order(
            alone,
            [t.id for t in sorted(alone.tasks, key=lambda t: t.seq) if t.kind in IN_ORDER_KINDS],
        )
        for step in range(job.steps):
            ids = sorted(
                (
                    t.id
                    for t in sched.graph.tasks
                    if t.kind in IN_ORDER_KINDS and sched.origin[t.id][:2] == (m, step)
                ),
                key=lambda i: sched.graph.tasks[i].seq,
            )
            assert compute_order(sched.graph, ids) == expected, (job.label, step)
            # in time: each pack's microbatches one after another, and packs started in order (a
            # pack on another GPU may start on its first microbatch while the one before finishes
            # its last)
            passes = {}
            for i in ids:
                t = sched.graph.tasks[i]
                passes.setdefault((t.kind == "FWD", t.pack), []).append(tl.start_s[i])
            assert all(starts == sorted(starts) for starts in passes.values())
            firsts = [starts[0] for starts in passes.values()]
            assert firsts == sorted(firsts)
        got = units[units.model == m]
        assert list(zip(got.step, got.unit)) == sorted(zip(got.step, got.unit))


def test_merged_beats_sequential_and_task_parallel_on_unequal_models():
    hw = simple_hardware(2, link=2e9)
    df = harmony.compare_schedules(unequal_jobs(), hw)
    assert list(df.schedule) == list(SCHEDULES)
    total = df.set_index("schedule").total_s
    assert total["merged"] <= total["task-parallel"] <= total["sequential"]
    assert total["merged"] < 0.95 * total["task-parallel"]
    assert df.fits.all() and (df.over_merged >= 1).all()
    assert (
        df.set_index("schedule").gpu_busy["merged"]
        > df.set_index("schedule").gpu_busy["task-parallel"]
    )


def headed(n_layers: int) -> ModelSpec:
    """Small layers and a large last one (a language-model head): the fused last
    pack alone takes most of a GPU."""

    def layer(i: int) -> LayerCost:
        p = 1_000_000 if i < n_layers - 1 else 6_000_000
        return LayerCost(
            name=f"l{i}",
            param_numel=p,
            input_numel_per_sample=10_000.0,
            fwd_time=Curve.linear(1e-3 * p / 1e6),
            bwd_time=Curve.linear(3e-3 * p / 1e6),
            fwd_extra=Curve.linear(0.0, 1e6),
            bwd_extra=Curve.linear(0.0, 2e6),
            update_time_s=0.005,
        )

    return ModelSpec(
        f"headed-{n_layers}", tuple(layer(i) for i in range(n_layers)), target_bytes_per_sample=8.0
    )


def test_units_of_two_models_share_a_gpu_only_when_they_fit():
    """Two such models take turns on one GPU: their heads would be loaded side by
    side (98.6 MB) if memory allowed; with 70 MB they are not, and the peak stays within."""
    jobs = [Job(headed(4), one_gpu_plan(4), steps=2, name=name) for name in ("a", "b")]
    unbounded = harmony.simulate_many(jobs, simple_hardware(1, link=2e9), "merged")
    assert max(unbounded.trace.summary.peak_memory.values()) > 90e6
    hw = simple_hardware(1, link=2e9, memory=70_000_000)
    assert harmony.simulate(jobs[0].spec, hw, jobs[0].plan).summary.fits  # each alone fits
    bounded = harmony.simulate_many(jobs, hw, "merged")
    assert bounded.trace.summary.fits
    assert max(bounded.trace.summary.peak_memory.values()) <= 70e6
    assert bounded.total_s < 1.1 * unbounded.total_s


@pytest.mark.parametrize("policy", ["harmony-pp", "harmony-no-grouping"])
def test_one_model_alone_plays_its_own_graph_step_after_step(policy):
    spec = tiny_spec(5, params=2_000_000, act=10_000.0)
    plan = Plan(policy, 1, 16, 4, 4, ((0, 2), (2, 3)), ((0, 1), (1, 3), (3, 5)))
    hw = simple_hardware(1, link=2e9)
    alone = harmony.build_graph(spec, hw, plan)
    one = schedule_many([Job(spec, plan)], hw, "task-parallel")
    deps = {t.id: (t.lane, sorted(t.deps)) for t in alone.tasks}
    assert {
        one.origin[t.id][2]: (t.lane, sorted(one.origin[d][2] for d in t.deps))
        for t in one.graph.tasks
    } == deps
    solo_s = harmony.simulate_graph(alone).iteration_s
    spilled = Plan(
        policy, 1, 16, 4, 4, plan.fwd_packs, plan.bwd_packs, {"offload_activations": True}
    )
    for schedule, each in (
        ("sequential", solo_s),
        ("task-parallel", solo_s),
        ("merged", harmony.simulate(spec, hw, spilled).iteration_s),
    ):  # merged spills activations
        assert harmony.simulate_many(
            [Job(spec, plan, steps=3)], hw, schedule
        ).total_s == pytest.approx(3 * each)


def test_sequential_runs_each_models_own_multi_gpu_plan():
    spec = tiny_spec(5, params=2_000_000, act=10_000.0)
    hw = simple_hardware(4, link=2e9)
    wide = Plan("harmony-dp", 4, 16, 4, 4, ((0, 1), (1, 3)), ((0, 1), (1, 3), (3, 5)))
    run = harmony.simulate_many(
        [Job(spec, one_gpu_plan(5), steps=2, parallel_plan=wide)], hw, "sequential"
    )
    assert run.total_s == pytest.approx(2 * harmony.simulate(spec, hw, wide).iteration_s, rel=1e-9)
    assert set(run.trace.timeline.device) >= {"gpu0", "gpu1", "gpu2", "gpu3"}


@pytest.mark.parametrize(
    "jobs, schedule, error, message",
    [
        ([], "merged", HarmonyError, "no jobs"),
        (["gpt2"], "merged", HarmonyError, r"jobs\[0\] is a str, not a harmony.Job"),
        (
            [Job(tiny_spec(4), one_gpu_plan(4))],
            "round-robin",
            HarmonyError,
            "unknown schedule 'round-robin'",
        ),
        (
            [Job(tiny_spec(4), Plan("harmony-dp", 4, 16, 4, 4, (), ((0, 4),)))],
            "task-parallel",
            HarmonyError,
            "runs each model on one GPU at a time, but its plan is for 4 GPUs",
        ),
        (
            [
                Job(
                    tiny_spec(4),
                    one_gpu_plan(4),
                    parallel_plan=Plan("harmony-dp", 4, 16, 4, 4, (), ((0, 4),)),
                )
            ],
            "sequential",
            HarmonyError,
            "plan uses 4 GPUs but hardware 'simple-2' has 2",
        ),
        # a pack's weights and gradient alone (800 MB) are more than the GPU
        (
            [Job(tiny_spec(4, params=100_000_000), one_gpu_plan(4))],
            "merged",
            OutOfMemoryError,
            "its plan alone needs .* MB on a GPU, more than the 500.0 MB",
        ),
    ],
)
def test_bad_jobs_are_refused_with_what_to_do(jobs, schedule, error, message):
    with pytest.raises(error, match=message):
        harmony.simulate_many(jobs, simple_hardware(2, memory=500_000_000), schedule)


def test_a_job_needs_positive_steps_and_a_plan():
    with pytest.raises(HarmonyError, match="steps must be a positive integer, got 0"):
        Job(tiny_spec(4), one_gpu_plan(4), steps=0)
    with pytest.raises(HarmonyError, match="a Job takes a harmony.ModelSpec and a harmony.Plan"):
        Job(tiny_spec(4), "harmony-pp")


# ---- for real, on an emulated server ----------------------------------------------------------
B = 12
SERVER = EmulatedServer(gpus=2, memory="4MB", h2d="400MB/s", d2h="400MB/s")
#: (blocks, seed, learning rate): a small grid of depths and learning rates
GRID = [(3, 0, 1e-2), (1, 1, 3e-3), (6, 2, 1e-2)]


def make_model(blocks: int, seed: int) -> nn.Sequential:
    """BatchNorm and dropout, so exactness covers running statistics and seeded masks."""
    torch.manual_seed(seed)
    layers = [nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(blocks):
        layers += [nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(32, 5))


def make_engine(blocks: int, seed: int, lr: float, model: nn.Module | None = None) -> Engine:
    model = make_model(blocks, seed) if model is None else model
    packs = tuple((i, min(i + 3, len(model))) for i in range(0, len(model), 3))
    plan = Plan("harmony-pp", 1, B, 4, 4, packs[:-1], packs)
    return Engine(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=lr),
        nn.functional.cross_entropy,
        device=SERVER.device(),
        minibatch_size=B,
        plan=plan,
        seed=seed,
    )


def minibatches(seed: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g))
        for _ in range(steps)
    ]


def trained_alone(blocks: int, seed: int, lr: float, data) -> tuple[Engine, list[float]]:
    engine = make_engine(blocks, seed, lr)
    return engine, [engine.step(x, y) for x, y in data]


@pytest.mark.parametrize("schedule", ["merged", "task-parallel"])
def test_train_many_trains_each_model_bitwise_as_alone(schedule):
    engines = [make_engine(*g) for g in GRID]
    data = [minibatches(10 + seed) for _, seed, _ in GRID]
    run = harmony.train_many(engines, data, SERVER, schedule)
    for g, engine, batches, losses in zip(GRID, engines, data, run.losses):
        alone, expected = trained_alone(*g, batches)
        for (name, a), b in zip(
            engine.model.state_dict().items(), alone.model.state_dict().values()
        ):
            assert torch.equal(a, b), f"model {g}: {name} differs"
        assert losses == expected
        assert engine.step_count == len(batches)
    s = run.trace.summary
    assert s.executor == "engine" and s.fits
    assert all(0 < v <= SERVER.device().capacity for v in s.peak_memory.values())
    assert sorted(run.trace.timeline.model.unique()) == [0, 1, 2]
    if schedule == "merged":
        assert (
            run.schedule.units().groupby("model").gpu.nunique() == 2
        ).any()  # a model changed GPU


def test_train_many_makes_the_weights_of_models_built_on_the_meta_device():
    """Weights the engines make (harmony.empty_weights) train as the same weights
    made in memory (harmony.materialize) alone."""

    def on_meta(blocks: int, seed: int) -> nn.Module:
        with harmony.empty_weights():
            return make_model(blocks, seed)

    engines = [make_engine(*g, model=on_meta(*g[:2])) for g in GRID]
    data = [minibatches(10 + seed) for _, seed, _ in GRID]
    harmony.train_many(engines, data, SERVER, "merged")
    for (blocks, seed, lr), engine, batches in zip(GRID, engines, data):
        twin = harmony.materialize(on_meta(blocks, seed), seed=seed)
        alone = make_engine(blocks, seed, lr, model=twin)
        for x, y in batches:
            alone.step(x, y)
        for (name, a), b in zip(
            engine.model.state_dict().items(), alone.model.state_dict().values()
        ):
            assert torch.equal(a, b), f"model {(blocks, seed)}: {name} differs"


def test_a_failure_leaves_every_model_at_a_whole_step():
    engines = [make_engine(*g) for g in GRID]
    data = [minibatches(10 + seed) for _, seed, _ in GRID]
    calls = {"n": 0}

    def fail_later(module, args):
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("injected failure")

    engines[2].layers[0].register_forward_pre_hook(fail_later)
    with pytest.raises(RuntimeError, match="injected"):
        harmony.train_many(engines, data, SERVER, "merged")
    for g, engine, batches in zip(GRID, engines, data):
        alone, _ = trained_alone(*g, batches[: engine.step_count])
        assert all(
            torch.equal(a, b)
            for a, b in zip(engine.model.state_dict().values(), alone.model.state_dict().values())
        )
    assert engines[2].step_count < len(data[2])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e, d: ([], [], SERVER), "no engines"),
        (lambda e, d: (e, d[:2], SERVER), "3 engines but 2 lists of minibatches"),
        (
            lambda e, d: (e, d, SERVER.device()),
            "train_many runs on a harmony.EmulatedServer, got EmulatedDevice",
        ),
        (
            lambda e, d: (e, [d[0], d[1], [(x[:6], y[:6]) for x, y in d[2]]], SERVER),
            "takes minibatches of 12 samples",
        ),
        (lambda e, d: ([e[0], e[1], e[0]], d, SERVER), "two engines train the same model"),
        (
            lambda e, d: (
                e[:2]
                + [
                    Engine(
                        make_model(1, 0),
                        torch.optim.SGD,
                        nn.functional.cross_entropy,
                        minibatch_size=B,
                    )
                ],
                d,
                SERVER,
            ),
            "has no plan",
        ),
    ],
)
def test_train_many_refuses_bad_input(change, message):
    engines = [make_engine(*g) for g in GRID]
    data = [minibatches(10 + seed, 1) for _, seed, _ in GRID]
    with pytest.raises(HarmonyError, match=message):
        harmony.train_many(*change(engines, data))


def tied_engine(seed: int) -> Engine:
    """Layers 2 and 6 share one weight (as an embedding and an LM head do), in different packs."""
    torch.manual_seed(seed)
    first, last = nn.Linear(32, 32), nn.Linear(32, 32)
    last.weight = first.weight
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.Tanh(),
        first,
        nn.GELU(),
        nn.Linear(32, 32),
        nn.GELU(),
        last,
        nn.Linear(32, 5),
    )
    plan = Plan("harmony-pp", 1, B, 4, 4, ((0, 3), (3, 6)), ((0, 3), (3, 6), (6, 8)))
    return Engine(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        nn.functional.cross_entropy,
        device=SERVER.device(),
        minibatch_size=B,
        plan=plan,
        seed=seed,
    )


def test_train_many_with_tied_weights_is_bitwise_as_alone():
    engines = [tied_engine(seed) for seed in (0, 1)] + [make_engine(*GRID[2])]
    data = [minibatches(20 + i) for i in range(3)]
    harmony.train_many(engines, data, SERVER, "merged")
    for i, (engine, batches) in enumerate(zip(engines, data)):
        alone = tied_engine(i) if i < 2 else make_engine(*GRID[2])
        for x, y in batches:
            alone.step(x, y)
        for (name, a), b in zip(
            engine.model.state_dict().items(), alone.model.state_dict().values()
        ):
            assert torch.equal(a, b), f"model {i}: {name} differs"
    tied = engines[0].model
    assert tied[2].weight is tied[6].weight  # still one parameter, updated once per step
