"""Harmony against PyTorch's own offload recipe (checkpointing, ``save_on_cpu``,
the optimizer on the host), measured on one emulated GPU."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import pandas as pd

from ...costs.hardware import parse_rate
from ...costs.zoo import example_input
from ...engine import EmulatedDevice, Engine
from ...engine.calibrate import calibrate
from ...engine.optim import FlatAdamW
from ...engine.profiler import default_sizes, link_like_1080ti, profile
from ...errors import OutOfMemoryError
from ...planner import search
from ..baselines import TorchOffload, fastest_microbatch, timed
from ..training import build_model, lm_loss, torch_threads


def gpt2_config(hidden: int, blocks: int, seq_len: int, vocab: int) -> dict[str, int]:
    """Settings of the zoo's ``gpt2-tiny`` for a GPT-2 of ``blocks`` x ``hidden`` (heads of 64)."""
    return dict(
        hidden=hidden,
        n_layer=blocks,
        heads=max(1, hidden // 64),
        seq_len=seq_len,
        max_position=seq_len,
        vocab=vocab,
    )


def torch_offload_comparison(
    hidden: int = 256,
    blocks: int = 6,
    minibatch: int = 32,
    memory: str = "56MB",
    steps: int = 5,
    seq_len: int = 64,
    vocab: int = 512,
    link: float | str | None = None,
    threads: int | None = 1,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Harmony and PyTorch's own offload (:class:`~harmony.workbench.baselines.TorchOffload`)
    training one GPT-2 (``blocks`` x ``hidden``) on one emulated GPU of ``memory``
    with links of ``link`` bytes/s (default: the 1080 Ti's compute : bandwidth
    ratio to this CPU, :func:`~harmony.engine.profiler.link_like_1080ti`).

    Harmony runs the best harmony-pp plan for the profile measured here; the
    recipe runs the microbatch size a user would pick (the fastest that fits,
    tried from the minibatch down). Both use FlatAdamW and start from the same
    weights. ``steps`` steps of each, interleaved (drift in the machine's load
    hits both alike) after a warm-up step; samples/s from the median step.
    Returns one row per system and the details: sizes, the link, the recipe's
    tuning, how far apart the two systems' weights are after the first step.
    A recipe that fits at no microbatch size gets a row saying so."""

    def optimizer(params):
        return FlatAdamW(params, lr=1e-4)

    with torch_threads(threads):
        rate = link_like_1080ti() if link is None else parse_rate(link, "link")
        device = EmulatedDevice(memory=memory, h2d=rate, d2h=rate)
        cfg = gpt2_config(hidden, blocks, seq_len, vocab)
        model = build_model("gpt2-tiny", 0, dropout=0.0, **cfg)
        (x,), y = example_input("gpt2-tiny", minibatch, **cfg)
        spec = profile(list(model), (x,), y, lm_loss, optimizer, name=f"gpt2 {blocks}x{hidden}")
        params = sum(p.numel() for p in model.parameters())
        hw = calibrate(device)
        best = search(spec, hw, minibatch, policies=("harmony-pp",), n_gpus=1, workers=1).iloc[0]
        plan = best["plan"]
        details: dict[str, Any] = {
            "model": f"GPT-2 {blocks} x {hidden}, seq {seq_len}",
            **_sizes(params, rate, device, spec, minibatch),
            "harmony_plan": plan.describe(),
            "harmony_simulated_s": float(best["iteration_s"]),
            "tuning": [],
        }

        def recipe(u: int) -> TorchOffload:
            return TorchOffload(copy.deepcopy(model), optimizer, lm_loss, device, u, spec)

        u = _recipe_microbatch(recipe, minibatch, plan.fwd_microbatch, x, y, details["tuning"])
        systems = {
            "harmony-pp": Engine(
                copy.deepcopy(model),
                optimizer,
                lm_loss,
                device=device,
                minibatch_size=minibatch,
                plan=plan,
            )
        }
        if u is not None:
            systems["torch offload"] = recipe(u)
        times = _race(systems, steps, x, y, details)
    df = _comparison(systems, times, plan, u, minibatch, device.capacity)
    return df, details


def _sizes(params: int, rate: float, device, spec, minibatch: int) -> dict[str, float]:
    """The comparison's sizes: parameters, the link, the GPU, the training footprint."""
    return {
        "params": params,
        "link_mb_s": rate / 1e6,
        "capacity_mb": device.capacity / 1e6,
        "weights_mb": params * 4 / 1e6,
        "footprint_mb": (params * 16 + sum(c.bwd_extra(minibatch) for c in spec.layers)) / 1e6,
    }


def _recipe_microbatch(recipe, minibatch: int, harmony_u: int, x, y, log: list) -> int | None:
    """The microbatch size a user would pick for the recipe: the fastest that fits,
    tried from the minibatch down (and Harmony's forward size); None if none fits."""
    try:  # weights and gradients alone may not fit, whatever the microbatch size
        recipe(minibatch)
    except OutOfMemoryError:
        return None
    return fastest_microbatch(
        lambda u: timed(lambda: recipe(u).step(x, y)),
        default_sizes(minibatch) + [harmony_u],
        log=log.append,
    )


def _race(systems: dict, steps: int, x, y, details: dict) -> dict[str, list[float]]:
    """Seconds of each system's steps, a warm-up and ``steps`` more, interleaved; after
    the first, how far apart the two systems' weights are (where both run)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(steps + 1):
        for name, system in systems.items():
            times[name].append(timed(lambda: system.step(x, y)))
        if step == 0 and "torch offload" in systems:
            details["first_step_max_weight_diff"] = max(
                (a - b).abs().max().item()
                for a, b in zip(
                    systems["harmony-pp"].model.parameters(), systems["torch offload"].master
                )
            )
    return times


def _comparison(
    systems: dict, times: dict[str, list[float]], plan, u: int | None, minibatch: int, capacity
) -> pd.DataFrame:
    """One row per system from its median step after the warm-up, and Harmony's
    speed-up and bytes ratio over each."""
    rows = []
    for name, system in systems.items():
        seconds = statistics.median(times[name][1:])
        if isinstance(system, Engine):
            s = system.trace.summary
            moved, peak, micro = (
                s.swap_bytes,
                s.peak_memory["gpu0"],
                f"{plan.fwd_microbatch}/{plan.bwd_microbatch}",
            )
        else:
            moved, peak, micro = sum(system.moved.values()), system.peak_memory, str(u)
        rows.append(
            {
                "system": name,
                "status": "ran",
                "microbatch": micro,
                "step_s": seconds,
                "samples_per_s": minibatch / seconds,
                "host_link_mb": moved / 1e6,
                "peak_mb": peak / 1e6,
                "peak_share": peak / capacity,
            }
        )
    if u is None:
        rows.append({"system": "torch offload", "status": "does not fit at any microbatch size"})
    df = pd.DataFrame(rows)
    first = df.iloc[0]
    df["harmony_speedup"] = first.samples_per_s / df.samples_per_s
    df["harmony_bytes_ratio"] = first.host_link_mb / df.host_link_mb
    return df
