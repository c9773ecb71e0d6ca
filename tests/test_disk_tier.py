"""The storage tiers below the GPU: a host budget that refuses to overflow, a
disk tier whose state round-trips bitwise, trains bitwise like state in
memory, survives kill -9 at any moment as the state of a committed step,
refuses bad directories up front, places state optimizer-first and paces
to a bandwidth.

Run as a script (``python tests/test_disk_tier.py crash DIR TRIALS SEED``),
this file is the crash harness of
:func:`test_kill_during_writes_leaves_a_committed_step`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from harmony import FlatAdamW
from harmony.costs.placement import staged_at_once
from harmony.engine.tiers import (
    DiskTier,
    DiskTierError,
    HostBudget,
    HostBudgetError,
    PackBytes,
    adopt_state,
    drop_state,
    export_state,
    files,
    measure_disk_bandwidth,
    place_state,
)

PACKS = 3
WIDTH = 32


# ---- a tiny model trained pack by pack, its AdamW state in memory or in a tier ----
def make_packs() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(PACKS)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def backward(packs: list[nn.Module], step: int) -> None:
    x, y = batch(step)
    for pack in packs:
        x = pack(x)
    nn.functional.mse_loss(x, y).backward()


def weights(pack: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.data for name, p in pack.named_parameters()}


def disk_step(packs, opts, tier: DiskTier, step: int, with_weights: bool) -> None:
    """One training step whose AdamW state (and with ``with_weights`` the weights)
    lives in ``tier``: per pack, read the state, step, write it back; then commit."""
    backward(packs, step)
    for i, (pack, opt) in enumerate(zip(packs, opts)):
        state = tier.read(i, "optimizer") if tier.has(i, "optimizer") else {}
        adopt_state(opt, state)
        opt.step()
        tier.write(i, "optimizer", export_state(opt))
        drop_state(opt)
        if state:
            state.release()
        if with_weights:
            tier.write(i, "weights", weights(pack))
        opt.zero_grad(set_to_none=True)
    tier.commit(step + 1)


def memory_step(packs, opts, step: int) -> None:
    backward(packs, step)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def snapshot(packs, state_of) -> list[torch.Tensor]:
    """Every weight and optimizer-state tensor, in a fixed order, copied."""
    out = []
    for i, pack in enumerate(packs):
        out += [t.clone() for t in weights(pack).values()]
        out += [t.clone() for _, t in sorted(state_of(i).items())]
    return out


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y))
        for x, y in zip(a, b)
    )


def tier_state(tier: DiskTier, i: int) -> dict[str, torch.Tensor]:
    if not tier.has(i, "optimizer"):
        return {}
    with tier.read(i, "optimizer", verify=True) as state:
        return {k: v.clone() for k, v in state.items()}


# ---- host budget -------------------------------------------------------------------
def test_budget_refuses_over_capacity_with_what_and_how():
    budget = HostBudget("1MB")
    assert budget.capacity == 1_000_000 and HostBudget("8GB").capacity == 8 * 10**9
    budget.charge("master weights", 600_000)
    with pytest.raises(
        HostBudgetError,
        match=r"optimizer state needs 500 KB but only 400 KB of "
        r"1 MB are free \(largest held: master weights "
        r"600 KB\)\. Give a larger budget",
    ):
        budget.charge("optimizer state", 500_000)
    with pytest.raises(HostBudgetError, match="already charged"):
        budget.charge("master weights", 1)
    with budget.hold("stash", 400_000):
        assert budget.free == 0
    t = budget.empty("gradients", 1000, torch.float32)
    assert t.numel() == 1000 and budget.in_use == 604_000 and budget.peak == 1_000_000
    assert budget.release("gradients") == 4000 and budget.release("master weights") == 600_000
    assert budget.in_use == 0 and budget.peak == 1_000_000
    with pytest.raises(HostBudgetError, match="not charged"):
        budget.release("master weights")
    assert HostBudget().capacity > 0  # what the machine has


# ---- disk tier ---------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_round_trip_is_bitwise(tmp_path, direct):
    g = torch.Generator().manual_seed(0)

    def bits(n: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)

    state = {
        "exp_avg": bits(10_000).view(torch.float32),  # every bit pattern, NaNs included
        "exp_avg_sq": bits(3 * 7 * 11).view(torch.float32).view(3, 7, 11),
        "bf16": bits(501).view(torch.bfloat16),
        "half": bits(17).view(torch.float16).view(2, 17),
        "double": bits(64).view(torch.float64),
        "index": bits(6).view(torch.int64),
        "step": torch.tensor(7.0),
        "empty": torch.empty(0, 4),
    }
    budget = HostBudget("10MB")
    # small chunks on 3 threads: chunks cross tensor boundaries and run out of order
    with DiskTier.create(
        tmp_path / "tier", state_bytes=10**6, budget=budget, chunk=8192, threads=3, direct=direct
    ) as tier:
        tier.write((2, 1), "optimizer", state)
        with tier.read((2, 1), "optimizer", verify=True) as back:
            assert list(back) == list(state) and bitwise(list(back.values()), list(state.values()))
        into = {k: torch.empty_like(v) for k, v in state.items()}
        tier.read((2, 1), "optimizer", into=into, verify=True)
        assert bitwise(list(into.values()), list(state.values()))
        tier.commit(0)
        assert any("staging" in name for name in budget.allocations)  # kept for the next read
    assert budget.in_use == 0
    with DiskTier.open(tmp_path / "tier", expect_step=0, direct=direct) as tier:
        with tier.read((2, 1), "optimizer") as back:
            assert bitwise(list(back.values()), list(state.values()))
        with pytest.raises(DiskTierError, match="holds no 'weights' state of pack 2-1"):
            tier.read((2, 1), "weights")
        with pytest.raises(DiskTierError, match="float32 \\[10000\\]; got a float32 \\[3\\]"):
            tier.read((2, 1), "optimizer", into={**into, "exp_avg": torch.empty(3)})


@pytest.mark.parametrize(
    "optimizer",
    [lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: FlatAdamW(ps, lr=1e-2)],
    ids=["adamw", "flat-adamw"],
)
def test_training_with_optimizer_state_on_disk_is_bitwise(tmp_path, optimizer):
    steps = 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packs = make_packs()
        opts = [optimizer(p.parameters()) for p in packs]
        for step in range(steps):
            memory_step(packs, opts, step)
        expected = snapshot(packs, lambda i: {k: v for k, v in export_state(opts[i]).items()})

        packs = make_packs()
        opts = [optimizer(p.parameters()) for p in packs]
        with DiskTier.create(tmp_path / "tier", budget=HostBudget("64MB"), chunk=4096) as tier:
            for step in range(steps):
                disk_step(packs, opts, tier, step, with_weights=False)
                assert all(not opt.state for opt in opts)  # no state held between updates
            assert bitwise(snapshot(packs, lambda i: tier_state(tier, i)), expected)
            # each write is read once, by the next step or by the check
            assert tier.bytes_read == tier.bytes_written > 0
    finally:
        torch.set_num_threads(threads)


def test_uncommitted_and_torn_writes_are_ignored(tmp_path):
    a, b, c = ({"x": torch.full((5000,), v)} for v in (1.0, 2.0, 3.0))
    slot0 = tmp_path / "pack-0.optimizer.0"
    with DiskTier.create(tmp_path, chunk=4096) as tier:
        tier.write(0, "optimizer", a)
        tier.commit(1)
        tier.write(0, "optimizer", b)
        tier.write(1, "optimizer", b)
        tier.commit(2)
        old = slot0.read_bytes()
        tier.write(0, "optimizer", a)  # a step that failed:
        tier.discard()  # its writes are forgotten
        with tier.read(0, "optimizer") as latest:
            assert torch.equal(latest["x"], b["x"])
        tier.write(0, "optimizer", c)  # step 3 under way: into the slot of step 1
        with tier.read(0, "optimizer") as latest:
            assert torch.equal(latest["x"], c["x"])  # a tier reads its own writes
    with open(slot0, "r+b") as f:  # killed before the header was written: new payload, old header
        f.write(old[:4096])
    with DiskTier.open(tmp_path) as tier:  # step 2, untouched
        assert tier.step == 2 and not tier.ignored
        with tier.read(0, "optimizer") as state:
            assert torch.equal(state["x"], b["x"])
    with pytest.raises(
        DiskTierError,
        match=r"pack-0\.optimizer\.0 is damaged: its checksums "
        r"do not match the manifest's \(0/optimizer as of "
        r"step 1\)",
    ):
        DiskTier.open(tmp_path, expect_step=1)
    with pytest.raises(DiskTierError, match="last committed at step 2, and step 3 was asked for"):
        DiskTier.open(tmp_path, expect_step=3)
    with pytest.raises(DiskTierError, match="already holds a run"):
        DiskTier.create(tmp_path)
    with DiskTier.open(tmp_path) as tier:  # the engine died after the tier's commit of step 3 ...
        tier.write(0, "optimizer", c)
        tier.commit(3)
    # ... and before its own checkpoint of step 3
    with DiskTier.open(tmp_path, expect_step=2) as tier:
        assert tier.step == 2
        assert tier.ignored == ["0/optimizer slot 0: holds step 3, newer than step 2"]
        with tier.read(0, "optimizer", verify=True) as state:
            assert torch.equal(state["x"], b["x"])
        with pytest.raises(DiskTierError, match="needs a step after 2"):
            tier.commit(2)
        tier.write(0, "optimizer", a)  # overwrites step 3's slot, not step 2's
        tier.commit(3)
    with DiskTier.open(tmp_path, expect_step=2) as tier, tier.read(0, "optimizer") as state:
        assert torch.equal(state["x"], b["x"])


# ---- a kill at any moment ----------------------------------------------------------
CRASH_STEPS = 400  # more than a trial gets through before its kill


def _reference() -> list[list[torch.Tensor]]:
    """The state after each step of the run, trained in memory."""
    packs = make_packs()
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in packs]
    states = [snapshot(packs, lambda i: {})]
    for step in range(CRASH_STEPS):
        memory_step(packs, opts, step)
        states.append(snapshot(packs, lambda i: export_state(opts[i])))
    return states


def _resume(directory: Path, **options) -> tuple[list[nn.Module], list, DiskTier]:
    tier = DiskTier.open(directory, **options)
    packs = make_packs()
    for i, pack in enumerate(packs):
        tier.read(i, "weights", into=weights(pack))
    return packs, [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in packs], tier


def _crash_harness(directory: Path, trials: int, seed: int) -> None:
    """Train in ``directory`` in a forked process, kill -9 it at a random moment,
    keep a copy of what it left; ``trials`` times, each resuming the last. Every
    other trial is killed at a random moment after the trainer committed a step
    in it, so the run advances however busy the machine is; the others, at any
    moment from its start."""
    rng = random.Random(seed)
    warm = nn.Parameter(torch.zeros(1))
    warm.grad = torch.ones(1)
    torch.optim.AdamW([warm]).step()  # a first step imports for seconds: not in each trial
    for trial in range(trials):
        committed, tell = os.pipe()
        pid = os.fork()
        # the trainer: writes paced to 10 MB/s in 16 KiB chunks, so kills land mid-file
        if pid == 0:
            try:
                os.close(committed)
                packs, opts, tier = _resume(directory, write_rate="10MB/s", chunk=16384)
                for step in range(tier.step, CRASH_STEPS):
                    disk_step(packs, opts, tier, step, with_weights=True)
                    os.write(tell, b"c")
            finally:
                os._exit(0)
        os.close(tell)
        if trial % 2:
            os.read(committed, 1)  # a step committed (or the trainer is done: end of file)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(committed)
        shutil.copytree(directory, directory.parent / f"trial-{trial}")
        print(f"trial {trial} killed", flush=True)


def test_kill_during_writes_leaves_a_committed_step(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = _reference()
        packs = make_packs()
        with DiskTier.create(tmp_path / "run") as tier:
            for i, pack in enumerate(packs):
                tier.write(i, "weights", weights(pack))
            tier.commit(0)
        trials = 6
        harness = [sys.executable, __file__, "crash", str(tmp_path / "run"), str(trials), "0"]
        done = subprocess.run(
            harness,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr
        steps = []
        for trial in range(trials):
            packs, opts, tier = _resume(tmp_path / f"trial-{trial}")
            with tier:
                step = tier.step
                steps.append(step)
                # the state of a committed step, never a mix of two
                assert bitwise(snapshot(packs, lambda i: tier_state(tier, i)), reference[step])
                # and it goes on as if it had never been interrupted
                for s in range(step, min(step + 3, CRASH_STEPS)):
                    disk_step(packs, opts, tier, s, with_weights=True)
                after = snapshot(packs, lambda i: tier_state(tier, i))
                assert bitwise(after, reference[tier.step])
        assert steps == sorted(steps) and steps[-1] > 0, steps
    finally:
        torch.set_num_threads(threads)


# ---- bad directories, before the first step --------------------------------------
def test_bad_directories_are_refused_up_front(tmp_path):
    missing = tmp_path / "no" / "tier"
    with pytest.raises(DiskTierError, match=f"{missing} does not exist, nor does its parent"):
        DiskTier.create(missing)
    DiskTier.create(tmp_path / "made").close()  # the last level is made
    assert (tmp_path / "made").is_dir()
    with pytest.raises(DiskTierError, match="does not exist: nothing to resume"):
        DiskTier.open(tmp_path / "missing")
    with pytest.raises(DiskTierError, match="has no committed state"):
        DiskTier.open(tmp_path / "made")
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="is a file"):
        DiskTier.create(tmp_path / "file")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(
        DiskTierError,
        match=rf"{tmp_path / 'big'}: the state \(.* x 2 slots, "
        r"double buffered\) needs .* on disk but the "
        r"filesystem has .* free",
    ):
        DiskTier.create(tmp_path / "big", state_bytes=free)
    assert not any((tmp_path / "big").iterdir())  # nothing written


def test_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    immutable = False
    try:
        if os.access(ro, os.W_OK):  # root writes through permissions: make the directory immutable
            immutable = (
                shutil.which("chattr") is not None
                and subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
            )
            if not immutable:
                pytest.skip(
                    "running as root, and chattr +i is not available to make a "
                    "directory unwritable"
                )
        with pytest.raises(DiskTierError, match=f"disk tier {ro} is not writable"):
            DiskTier.create(ro)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o700)


# ---- placement, pacing, bandwidth ------------------------------------------------
def test_placement_moves_optimizer_state_out_first():
    packs = [PackBytes(weights=100, gradients=100, optimizer=200)] * 8  # 3200 in all
    assert place_state(packs, 4000, reserve=100).on_disk == ()
    placed = place_state(packs, 3000, reserve=100)  # the last pack's optimizer state first
    assert placed.on_disk == tuple((q, "optimizer") for q in (7, 6, 5, 4, 3))
    assert placed.where(2, "optimizer") == "host" and placed.where(3, "optimizer") == "disk"
    # state kept, staging for 3 packs (one updated, one read ahead, one written back), reserve
    assert placed.host_bytes == 3200 - 1000 + 3 * 200 + 100 <= 3000
    assert placed.read_bytes_per_step == placed.write_bytes_per_step == 1000 == placed.disk_bytes
    assert placed.disk_seconds(read_rate=100, write_rate=50) == 1000 / 100 + 1000 / 50
    more = place_state(packs, 2250, reserve=100)  # then master weights, before any gradient
    assert [k for _, k in more.on_disk] == ["optimizer"] * 8 + ["weights"] * 4
    assert more.host_bytes == 3200 - 2000 + 3 * 300 + 100 <= 2250  # staging grew to 3 x 300
    thrice = place_state(packs, 2250, reserve=100, weight_reads=3)
    assert thrice.read_bytes_per_step == 1600 + 3 * 400
    with pytest.raises(HostBudgetError, match="even with all the state on disk"):
        place_state(packs, 500, reserve=100)


def test_placement_stages_a_large_pack_beside_its_neighbours():
    """A first pack 4x the others (a large vocabulary's embedding): staging holds
    it beside the two packs updated next to it, not three copies of it, so moving
    its optimizer state frees more than it stages."""
    big, small = PackBytes(400, 0, 800), PackBytes(100, 0, 200)
    packs = [big] + [small] * 8  # 3600 in all (gradients stay in the reserve)
    placed = place_state(packs, 2500, reserve=100)
    assert placed.on_disk == tuple((q, "optimizer") for q in range(8, -1, -1))
    assert placed.staging_bytes == 800 + 2 * 200  # three times the largest: 2400
    assert placed.host_bytes == 3600 - 2400 + 1200 + 100 <= 2500
    with pytest.raises(HostBudgetError, match="even with all the state on disk"):
        place_state(packs, 1800, reserve=100)  # 1800 staged beside 100


def test_staging_counts_neighbours_among_the_packs_on_disk():
    assert staged_at_once([800, 0, 0, 200, 200, 0, 100]) == 1200  # packs in host memory skipped
    assert staged_at_once([300, 300]) == 600 and staged_at_once([0, 0]) == 0
    rng = random.Random(0)
    for _ in range(200):  # a move never stages more than it frees (it may stage less)
        sizes = [rng.choice([0, 0, 1, 5, 40]) for _ in range(rng.randint(1, 9))]
        i, x = rng.randrange(len(sizes)), rng.choice([1, 5, 40])
        more = sizes[:i] + [sizes[i] + x] + sizes[i + 1 :]
        assert staged_at_once(more) <= staged_at_once(sizes) + x
    assert staged_at_once([40, 0, 1, 40]) == 81 > staged_at_once([40, 1, 1, 40]) == 42


def _record_pacing(monkeypatch, io) -> list[dict]:
    """Each paced payload of ``io`` as its pacer planned it (route, start, planned
    end) and when the caller got control back."""
    planned, real = [], io.pacer.wait

    def wait(route, nbytes, max_rate, started):
        end = real(route, nbytes, max_rate, started)
        planned.append(
            {"route": route, "started": started, "end": end, "returned": time.perf_counter()}
        )
        return end

    monkeypatch.setattr(io.pacer, "wait", wait)
    return planned


def test_paced_mode_takes_bytes_over_bandwidth(tmp_path, monkeypatch):
    """A paced write and read each queue bytes / bandwidth on their own link, and the
    caller gets control back no sooner than that (the pacer's plan, not a stopwatch:
    a busy machine only makes it later)."""
    state = {"x": torch.zeros(8 << 20, dtype=torch.uint8)}  # 8.4 MB
    nbytes = state["x"].numel()
    with DiskTier.create(tmp_path, read_rate="40MB/s", write_rate="30MB/s", chunk=1 << 20) as tier:
        paced = _record_pacing(monkeypatch, tier.io)
        tier.write(0, "optimizer", state)
        tier.read(0, "optimizer").release()
    (write,), (read,) = [[p for p in paced if p["route"] == (how,)] for how in ("write", "read")]
    assert write["end"] - write["started"] == pytest.approx(nbytes / 30e6, rel=1e-6)
    assert read["end"] - read["started"] == pytest.approx(nbytes / 40e6, rel=1e-6)
    assert all(p["returned"] >= p["end"] for p in paced)


def test_a_paced_shared_disk_takes_the_sum_of_a_read_and_a_write_at_once(tmp_path, monkeypatch):
    """Paced per direction, a read and a write at once each get their bandwidth;
    paced as a disk whose reads and writes share its time, they take the sum."""
    state = {"x": torch.zeros(4 << 20, dtype=torch.uint8)}  # 4.2 MB: 0.1 s at 42 MB/s
    alone = state["x"].numel() / 42e6

    def both_at_once(shared: bool) -> list[dict]:
        with DiskTier.create(
            tmp_path / str(shared), read_rate=42e6, write_rate=42e6, shared=shared, chunk=1 << 20
        ) as tier:
            tier.write(0, "optimizer", state)
            paced = _record_pacing(monkeypatch, tier.io)
            with ThreadPoolExecutor(2) as pool:
                jobs = [
                    pool.submit(lambda: tier.read(0, "optimizer").release()),
                    pool.submit(tier.write, 1, "optimizer", state),
                ]
                for job in jobs:
                    job.result()
        assert len(paced) == 2 and all(p["returned"] >= p["end"] for p in paced)
        return paced

    # one queue of disk time: whichever came second ends a payload's time after the first
    shared = both_at_once(shared=True)
    assert {p["route"] for p in shared} == {(files.SHARED_DISK,)}
    first = min(p["started"] for p in shared)
    assert max(p["end"] for p in shared) >= first + 2 * alone * (1 - 1e-9)
    # a queue per direction: each payload ends its own time after it started
    apart = both_at_once(shared=False)
    assert {p["route"] for p in apart} == {("read",), ("write",)}
    for p in apart:
        assert p["end"] - p["started"] == pytest.approx(alone, rel=1e-6)
    with pytest.raises(DiskTierError, match="give read_rate and write_rate"):
        DiskTier.create(tmp_path / "one", read_rate=42e6, shared=True)


def test_reads_do_not_queue_behind_writes(tmp_path, monkeypatch):
    """Reads and writes have I/O threads of their own: each request here waits (up
    to a minute) until one of the other direction is in flight, so requests queued
    behind the other direction's would never start, and the step would fail."""
    real = files._transfer
    in_flight = {True: threading.Event(), False: threading.Event()}
    met = []

    def transfer(fd, buffer, offset, write):
        in_flight[write].set()
        met.append(in_flight[not write].wait(timeout=60))
        real(fd, buffer, offset, write)

    io = files.ChunkIO(threads=2, chunk=1 << 20)
    data = torch.zeros(4 << 20, dtype=torch.uint8)  # 4 chunks: two rounds of two threads
    view = files.byte_view(data)
    try:
        fd = io.open(tmp_path / "f", write=True)
        io.write(fd, 0, [(0, view)], len(view), checksum=False)
        monkeypatch.setattr(files, "_transfer", transfer)
        with ThreadPoolExecutor(2) as pool:
            read = pool.submit(io.read, fd, 0, [(0, view)], len(view), False)
            write = pool.submit(io.write, fd, len(view), [(0, view)], len(view), False)
            read.result(), write.result()
        os.close(fd)
    finally:
        io.close()
    assert len(met) == 8 and all(met)  # every request found the other direction under way
    assert io.buffer_bytes == 2 * 2 * (1 << 20)  # a buffer per thread, per direction


def test_measured_bandwidth_is_positive(tmp_path):
    measured = measure_disk_bandwidth(tmp_path, "8MB")
    assert measured.read > 0 and measured.write > 0 and not list(tmp_path.iterdir())
    # a read and a write at once, against each alone: the disk's time shared or not
    assert measured.mixed_s > 0 and len(measured.alone_s) == 2
    assert measured.shared == (
        measured.mixed_s > 0.5 * max(measured.alone_s) + 0.5 * sum(measured.alone_s)
    )
    assert "at once" in str(measured)


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    torch.set_num_threads(1)
    _crash_harness(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))


def test_the_tiers_checksum_is_zlibs_crc32():
    """Files written with zlib's CRC-32 (or where isal is missing) read anywhere:
    the tier's checksum is the same function, whatever computes it."""
    import zlib

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy()
    for part in (data, data[1:], data[: 1 << 20], data[5:9]):
        assert files.crc32(part) == zlib.crc32(part)
