"""The engine with a disk tier: state that does not fit the host budget lives on
disk, read and written around each update and weight load; training is
bitwise the in-memory run's, disk bytes are the graph's closed form, a failed
step leaves the last good step's state on disk, a kill -9 at any moment resumes
bitwise, and a bad directory is refused before anything changes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harmony import EmulatedDevice, EmulatedServer, Engine, FlatAdamW, HarmonyError, Plan
from harmony.costs.placement import HostMemoryError
from harmony.engine.tiers import DiskTierError
from harmony.errors import NonFiniteError
from harmony.graph import DISK_IN, DISK_OUT
from harmony.policies import swap_volume
from harmony.policies.disk_tier import SHARED

D, B, LAYERS = 128, 8, 16
# per Linear: 66 KB of weights and gradients, 132 KB of AdamW state; 2.1 MB in all. Host
# budgets (the update journal's copies of what stays in memory count too):
# Harmony's policies hold the gradients in two pack slots there, not the whole model's
OPTIMIZER_ON_DISK = "1.8MB"  # every pack's optimizer state on disk, the weights in memory
# the master weights too (two GPUs: room to stage each one's next weight load too)
WEIGHTS_ON_DISK = {1: "1.0MB", 2: "1.1MB"}
# the same for a policy whose packs' gradients build up together over the minibatch
WHOLE_GRADIENTS = {"harmony-no-grouping": ("2.1MB", "1.4MB")}
ROOMY = "1GB"
FAST_DISK = "2GB/s,2GB/s"
TESTS = Path(__file__).parent
POISON = {"on": False}  # makes layer 1's backward send NaN to layer 0's weight


class PoisonableGELU(nn.GELU):
    def forward(self, x):
        return _Poison.apply(super().forward(x))


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan") if POISON["on"] else g


@pytest.fixture(autouse=True)
def budgets_for_the_state_alone(monkeypatch):
    """The budgets above are for the engine's own state: leave out what the process
    holds besides (measured, so it varies) and the emulated GPU's memory
    (tests/test_host_budget.py checks that the engine takes them out of the budget)."""
    state_alone(monkeypatch.setattr)


def state_alone(setattr) -> None:
    import harmony.engine.disk_setup as disk_setup
    import harmony.engine.engine as engine_module

    setattr(engine_module, "besides_the_model", lambda module: 0)
    setattr(disk_setup, "device_memory_in_host", lambda *a: 0)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    acts = [PoisonableGELU()] + [nn.GELU() for _ in range(7)]
    return nn.Sequential(*[m for a in acts for m in (nn.Linear(D, D), a)])


def batch(step: int, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s minibatch: ``B`` samples of ``D`` features, or of ``seq``
    tokens of ``D`` features each."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (B, D) if seq is None else (B, seq, D)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def plan_for(policy: str, gpus: int) -> Plan:
    fwd = tuple((i, i + 2) for i in range(0, LAYERS - 2, 2))
    bwd = tuple((i, i + 2) for i in range(0, LAYERS, 2))
    return Plan(policy, gpus, B, 2, 2, fwd, bwd)


def device(gpus: int):
    if gpus == 1:
        return EmulatedDevice("8MB", "1GB/s", "1GB/s")
    return EmulatedServer(gpus, "8MB", "1GB/s", "1GB/s")


def hardware(gpus: int):
    """The device as the planner sees it, with no calibration (it takes seconds)."""
    return device(gpus).hardware()


def adamw(ps):
    return FlatAdamW(ps, lr=1e-2)


def engine(plan: Plan, host: str = ROOMY, tier: Path | None = None, opt=adamw, **kw) -> Engine:
    if tier is not None:
        kw.update(disk_dir=tier, disk=kw.get("disk", FAST_DISK))
    return Engine(
        make_model(),
        opt,
        nn.functional.mse_loss,
        device=device(plan.n_gpus),
        minibatch_size=B,
        plan=plan,
        hardware=hardware(plan.n_gpus),
        host_memory=host,
        **kw,
    )


def train(e: Engine, steps: int, seq: int | None = None) -> Engine:
    while e.step_count < steps:
        e.step(*batch(e.step_count, seq))
    return e


def weights(e: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.state_dict()["model"].items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_REFERENCE: dict = {}


def reference(policy: str, gpus: int, steps: int, seq: int | None = None) -> dict:
    """The weights of the run with everything in host memory."""
    key = (policy, gpus, steps, seq)
    if key not in _REFERENCE:
        _REFERENCE[key] = weights(train(engine(plan_for(policy, gpus)), steps, seq))
    return _REFERENCE[key]


# ---- exact, and the bytes of the closed form -------------------------------------------
@pytest.mark.parametrize(
    "policy, gpus",
    [("harmony-pp", 1), ("harmony-pp", 2), ("harmony-dp", 2), ("harmony-no-grouping", 1)],
)
@pytest.mark.parametrize("kinds", [1, 2], ids=["optimizer", "weights"])
def test_state_on_disk_trains_bitwise_like_in_memory(tmp_path, policy, gpus, kinds):
    plan = plan_for(policy, gpus)
    budgets = WHOLE_GRADIENTS.get(policy, (OPTIMIZER_ON_DISK, WEIGHTS_ON_DISK[gpus]))
    e = train(engine(plan, budgets[kinds - 1], tmp_path / "tier"), 3)
    try:
        on_disk = e.disk.placement.on_disk
        assert len({k for _, k in on_disk}) == kinds and len(on_disk) == 8 * kinds
        # Harmony's pipeline on one GPU: a pack's backward weight load takes its update's read
        rides = kinds == 2 and policy == "harmony-pp" and gpus == 1
        assert e.disk.placement.weights_with_update == rides
        # the gradients: in two pack-sized slots, or one buffer for the whole model
        whole = policy in WHOLE_GRADIENTS
        assert (e.gradient_slots is None) == whole
        held = e.host.layout.allocated_bytes + (0 if whole else e.gradient_slots.allocated_bytes)
        assert held == (8 if whole else 2) * (D * D + D) * 4
        # nothing of it stays in host memory between steps
        for unit in e.disk.units.values():
            assert not unit.opt.state
            placeholders = [p.stride() == (0, 0) for _, p in unit.params if p.dim() == 2]
            assert all(placeholders) if kinds == 2 else not any(placeholders)
        assert same(weights(e), reference(policy, gpus, 3))
        # a step's disk bytes: measured == simulated == closed form (the optimizer state
        # exists from the second step on: the first reads none)
        measured = e.trace.summary.bytes_by_kind
        simulated = e.simulate().summary.bytes_by_kind
        closed = swap_volume(e.spec, plan, e.hardware())
        for kind in (DISK_IN, DISK_OUT):
            assert measured[kind] == simulated[kind] == closed[kind] > 0
        budget = e.host_settings.budget
        assert budget.peak <= budget.capacity
    finally:
        e.close()


def test_a_disk_whose_reads_and_writes_share_its_time(tmp_path):
    """``disk="<read>,<write>,shared"``: the tier is paced as one disk that reads
    and writes take turns on, the graph the engine plays and simulates has the
    shared link, and the run is still bitwise the in-memory one."""
    plan = plan_for("harmony-pp", 1)
    disk = f"{FAST_DISK},shared"
    e = train(engine(plan, OPTIMIZER_ON_DISK, tmp_path / "tier", disk=disk), 3)
    try:
        assert e.hardware().disk_shared and e.disk.tier.io.shared
        assert SHARED in e._graph_cache.links
        assert same(weights(e), reference("harmony-pp", 1, 3))
        measured, simulated = e.trace.summary, e.simulate().summary
        for kind in (DISK_IN, DISK_OUT):
            assert measured.bytes_by_kind[kind] == simulated.bytes_by_kind[kind] > 0
    finally:
        e.close()


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_other_optimizers_state_on_disk_has_the_closed_forms_bytes(tmp_path, name):
    """The engine counts the state its optimizer keeps (one tensor per parameter
    for SGD with momentum and RMSprop, three for AMSGrad), so the placement and
    the closed form are that optimizer's, and the run is bitwise the in-memory one."""
    plan, opt = plan_for("harmony-pp", 1), OPTIMIZERS[name]
    e = train(engine(plan, "1.9MB", tmp_path / "tier", opt=opt), 3)
    try:
        assert e.spec.optimizer == name
        assert {k for _, k in e.disk.placement.on_disk} >= {"optimizer"}
        assert same(weights(e), weights(train(engine(plan, opt=opt), 3)))
        measured = e.trace.summary.bytes_by_kind
        closed = swap_volume(e.spec, plan, e.hardware())
        for kind in (DISK_IN, DISK_OUT):
            assert measured[kind] == e.simulate().summary.bytes_by_kind[kind] == closed[kind] > 0
    finally:
        e.close()


def test_state_that_does_not_fit_without_a_disk_says_what_to_give():
    e = engine(plan_for("harmony-pp", 1), OPTIMIZER_ON_DISK)
    with pytest.raises(HarmonyError, match=r"give it a directory for a disk tier \(disk_dir=\)"):
        e.step(*batch(0))
    with pytest.raises(HarmonyError, match="give its directory, disk_dir="):
        engine(plan_for("harmony-pp", 1), OPTIMIZER_ON_DISK, disk=FAST_DISK)


def test_the_cpu_backend_computes_on_the_weights_where_the_tier_read_them(tmp_path, monkeypatch):
    """A device that computes on host memory makes no copy of master weights read
    from disk: the weight load uses the tier's staging in place and gives it back
    when the graph frees the weights. Bitwise the in-memory run."""
    from harmony.engine.step.disk import DiskSteps

    calls = {"in place": 0, "copied": 0}
    hold, copied = DiskSteps.hold_loaded_weights, DiskSteps.weights_copied

    def counted(name, method):
        def wrapper(self, task):
            calls[name] += 1
            return method(self, task)

        return wrapper

    monkeypatch.setattr(DiskSteps, "hold_loaded_weights", counted("in place", hold))
    monkeypatch.setattr(DiskSteps, "weights_copied", counted("copied", copied))

    def run(host, tier):
        return train(
            Engine(
                make_model(),
                adamw,
                nn.functional.mse_loss,
                device="cpu",
                hardware=hardware(1),
                minibatch_size=B,
                plan=plan_for("harmony-pp", 1),
                host_memory=host,
                **({} if tier is None else dict(disk_dir=tier, disk=FAST_DISK)),
            ),
            3,
        )

    e = run(WEIGHTS_ON_DISK[1], tmp_path / "tier")
    try:
        assert {k for _, k in e.disk.placement.on_disk} == {"optimizer", "weights"}
        assert calls["in place"] > 0 and calls["copied"] == 0
        slots = e.disk.load_slots  # every load given back, at most two kept
        assert not slots._held and len(slots._free) <= 2
        got = weights(e)
    finally:
        e.close()
    memory = run(ROOMY, None)
    try:
        assert same(got, weights(memory))
    finally:
        memory.close()


# ---- a failed step ----------------------------------------------------------------------
@pytest.mark.parametrize("host", [OPTIMIZER_ON_DISK, WEIGHTS_ON_DISK[1]])
def test_a_failed_step_leaves_the_state_of_the_last_good_step(tmp_path, host):
    e = train(engine(plan_for("harmony-pp", 1), host, tmp_path / "tier"), 2)
    try:
        before = weights(e)
        before_opt = e.state_dict()["optimizer"]["state"]
        POISON["on"] = True
        try:  # layer 0's gradient is NaN: every other pack has been updated by then
            with pytest.raises(NonFiniteError, match="layers 0..1"):
                e.step(*batch(2))
        finally:
            POISON["on"] = False
        assert e.disk.tier.step == e.step_count == 2
        assert same(weights(e), before)
        after_opt = e.state_dict()["optimizer"]["state"]
        assert all(same(after_opt[k], before_opt[k]) for k in before_opt)
        assert same(weights(train(e, 3)), reference("harmony-pp", 1, 3))
    finally:
        e.close()


def leave_free(setattr, free: int) -> None:
    """Make the tier's room checks see a filesystem with ``free`` bytes free."""
    real = shutil.disk_usage
    setattr(
        "harmony.engine.tiers.directory.shutil.disk_usage",
        lambda p: real(p)._replace(free=free),
    )


def test_bad_disk_directories_are_refused_before_anything_changes(tmp_path, monkeypatch):
    plan = plan_for("harmony-pp", 1)
    with pytest.raises(DiskTierError, match="does not exist, nor does its parent"):
        engine(plan, OPTIMIZER_ON_DISK, tmp_path / "no" / "tier")
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="is a file"):
        engine(plan, OPTIMIZER_ON_DISK, tmp_path / "file")
    # too small: found at the first step, once the state's size is known
    e = engine(plan, OPTIMIZER_ON_DISK, tmp_path / "tier")
    start = weights(e)
    with monkeypatch.context() as full:
        leave_free(full.setattr, 100_000)
        with pytest.raises(DiskTierError, match=r"x 2 slots.* but the filesystem has 100 KB"):
            e.step(*batch(0))
    assert e.step_count == 0 and e.disk is None and same(weights(e), start)
    assert not (tmp_path / "tier" / "manifest.json").exists()
    assert e.host_settings.budget.in_use == 0  # what the attempt charged is given back
    try:  # the same engine, once there is room
        assert same(weights(train(e, 3)), reference("harmony-pp", 1, 3))
    finally:
        e.close()
    with pytest.raises(HostMemoryError, match="needs at least .* even with its optimizer state"):
        engine(plan, "700KB", tmp_path / "tiny").step(*batch(0))


# ---- stashes on disk --------------------------------------------------------------------
# samples of SEQ tokens: each layer's input is 128 KB a sample, so the stashes of the 7
# packs that stash are 7.3 MB a minibatch, more than the 2.1 MB of state
SEQ = 256
STASHES = "8MB"  # the state stays in host memory, the stashes go to disk
STASHES_AND_STATE = "3MB"  # state goes too


@pytest.mark.parametrize(
    "policy, gpus, host, options",
    [
        ("harmony-pp", 1, STASHES, {}),
        ("harmony-pp", 1, STASHES_AND_STATE, {}),
        ("harmony-pp", 2, STASHES, {}),
        ("harmony-no-grouping", 1, STASHES_AND_STATE, {}),
        ("hydra", 1, STASHES_AND_STATE, {}),
        ("harmony-pp", 1, STASHES, {"offload_activations": True}),
        ("harmony-pp", 1, STASHES_AND_STATE, {"precision": "bf16"}),
    ],
)
def test_stashes_on_disk_train_bitwise_like_in_memory(tmp_path, policy, gpus, host, options):
    """Offloaded activations (ACT_OUT / ACT_IN) go with the stashes; under mixed
    precision the pieces are bfloat16, as they cross the links."""
    plan = plan_for(policy, gpus).with_options(**options)
    kw = {"precision": options["precision"]} if "precision" in options else {}
    e = engine(plan, host, tmp_path / "tier", **kw)
    try:
        train(e, 1, SEQ)
        placement = e.disk.placement
        assert placement.stashes_on_disk and bool(placement.on_disk) == (host != STASHES)
        # a scratch file in the tier's directory while the run goes on, gone after it
        scratch = e.disk.stashes.path
        assert scratch.parent == tmp_path / "tier" and scratch.exists()
        train(e, 3, SEQ)
        expected = (
            weights(train(engine(plan, **kw), 3, SEQ))
            if options
            else reference(policy, gpus, 3, SEQ)
        )
        assert same(weights(e), expected)
        measured = e.trace.summary.bytes_by_kind
        assert measured.get("ACT_OUT") or "offload_activations" not in options
        simulated = e.simulate().summary.bytes_by_kind
        closed = swap_volume(e.spec, plan, e.hardware())
        for kind in (DISK_IN, DISK_OUT):
            assert measured[kind] == simulated[kind] == closed[kind] >= placement.stash_disk_bytes
        budget = e.host_settings.budget
        assert budget.peak <= budget.capacity
    finally:
        e.close()
    assert not scratch.exists()


def test_the_cpu_backend_reads_stashes_back_where_it_computes(tmp_path):
    """On the cpu backend a stash read back is the device's memory as it is (no copy)."""
    plan = plan_for("harmony-pp", 1)
    e = Engine(
        make_model(),
        adamw,
        nn.functional.mse_loss,
        device="cpu",
        minibatch_size=B,
        plan=plan,
        hardware=hardware(1),
        host_memory=STASHES_AND_STATE,
        disk_dir=tmp_path / "tier",
        disk=FAST_DISK,
    )
    try:
        train(e, 3, SEQ)
        assert e.disk.placement.stashes_on_disk
        assert same(weights(e), reference("harmony-pp", 1, 3, SEQ))
        assert (
            e.trace.summary.bytes_by_kind[DISK_IN] == e.simulate().summary.bytes_by_kind[DISK_IN]
        )
    finally:
        e.close()


def test_too_little_disk_for_the_stashes_is_refused_before_the_first_step(tmp_path, monkeypatch):
    e = engine(plan_for("harmony-pp", 1), STASHES, tmp_path / "tier")
    start = weights(e)
    with monkeypatch.context() as full:
        leave_free(full.setattr, 5_000_000)
        with pytest.raises(
            DiskTierError, match=r"tier: a step's stashes \(6.\d+ MB\) needs .* 5 MB free"
        ):
            e.step(*batch(0, SEQ))
    try:
        assert e.step_count == 0 and e.disk is None and same(weights(e), start)
        assert e.host_settings.budget.in_use == 0
        assert same(weights(train(e, 3, SEQ)), reference("harmony-pp", 1, 3, SEQ))
    finally:
        e.close()


# ---- kill -9 ----------------------------------------------------------------------------
CHILD = """
import sys
sys.path.insert(0, {tests!r})
import test_disk_tier_engine as t
t.child({tier!r}, {ckpt!r}, {steps}, {stall!r}, {seq!r}, {host!r})
"""


def child(
    tier: str,
    ckpt: str,
    steps: int,
    stall: tuple[str, int] | None,
    seq: int | None = None,
    host: str = WEIGHTS_ON_DISK[1],
) -> None:
    """Train to ``steps`` on ``batch(step, seq)`` with a ``host`` budget (resuming
    from ``ckpt`` if there), saving after every step; ``stall`` (where, step): say
    so, then sleep there, to be killed."""
    import time

    import harmony.engine.engine as engine_module
    from harmony.engine.tiers import files

    state_alone(setattr)  # as budgets_for_the_state_alone does in the tests

    if Path(ckpt).exists():
        e = resume(ckpt, host)
    else:
        e = engine(plan_for("harmony-pp", 1), host, Path(tier))

    moved = {"read": 0, "write": 0}  # chunks in the step to stall in

    def hang(where: str):
        if stall == (where, e.step_count):
            print("stalled", flush=True)
            time.sleep(60)

    chunk = files.ChunkIO._chunk

    def paused(self, fd, offset, nbytes, pieces, how, checksum):
        crc = chunk(self, fd, offset, nbytes, pieces, how, checksum)
        moved[how] += stall is not None and e.step_count == stall[1]
        if moved[how] == 100:  # some files of the step whole, this one torn
            hang(how)
        return crc

    files.ChunkIO._chunk = paused
    write = engine_module.write_checkpoint  # called after the tier's commit
    engine_module.write_checkpoint = lambda *a: (hang("save"), write(*a))[1]
    while e.step_count < steps:
        e.step(*batch(e.step_count, seq))
        e.save(ckpt)
    e.close()


@pytest.mark.heavy
def test_kill_9_anywhere_in_a_step_resumes_bitwise(tmp_path):
    """Killed in the middle of step 2, writing a DISK_OUT (its file torn, other
    packs' state of the step written), and between the tier's commit of step 3
    and the engine's checkpoint of it (the tier a step ahead: it goes back
    one), then run to the end."""
    tier, ckpt = tmp_path / "tier", tmp_path / "run.ckpt"

    def run(stall):
        return child_process(tier, ckpt, 5, stall)

    for stall in [("write", 2), ("save", 3)]:
        proc = run(stall)
        try:
            assert proc.stdout.readline().strip() == "stalled"
        finally:
            proc.kill()  # SIGKILL
            proc.wait()
    assert run(None).wait(timeout=120) == 0
    e = resume(ckpt, WEIGHTS_ON_DISK[1])
    try:
        assert e.step_count == 5
        with pytest.raises(HarmonyError, match="step first, or save"):
            e.state_dict()
        assert same(weights(train(e, 6)), reference("harmony-pp", 1, 6))
    finally:
        e.close()


def resume(ckpt: Path, host: str) -> Engine:
    """The run checkpointed in ``ckpt`` (by :func:`child`), with a ``host`` budget."""
    return Engine.load(
        ckpt,
        make_model(),
        adamw,
        nn.functional.mse_loss,
        device=device(1),
        hardware=hardware(1),
        host_memory=host,
        disk=FAST_DISK,
    )


def child_process(tier, ckpt, steps, stall, seq=None, host=WEIGHTS_ON_DISK[1]):
    """:func:`child` in a process of its own, its output piped."""
    code = CHILD.format(
        tests=str(TESTS),
        tier=str(tier),
        ckpt=str(ckpt),
        steps=steps,
        stall=stall,
        seq=seq,
        host=host,
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.heavy
def test_kill_9_while_stashes_are_on_disk_resumes_bitwise(tmp_path):
    """Killed in step 2 amid the writes of its stashes and state: the scratch file
    holds nothing the resumed run needs (it starts it again), and the run ends
    bitwise the in-memory one."""
    tier, ckpt = tmp_path / "tier", tmp_path / "run.ckpt"
    proc = child_process(tier, ckpt, 4, ("write", 2), SEQ, STASHES_AND_STATE)
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    assert (tier / "stashes.scratch").exists()  # left by the killed run
    assert child_process(tier, ckpt, 4, None, SEQ, STASHES_AND_STATE).wait(timeout=120) == 0
    e = resume(ckpt, STASHES_AND_STATE)
    try:
        assert e.step_count == 4
        train(e, 5, SEQ)
        assert e.disk.placement.stashes_on_disk
        assert same(weights(e), reference("harmony-pp", 1, 5, SEQ))
    finally:
        e.close()
