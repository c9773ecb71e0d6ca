"""Lesson 4: many GPUs."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

import pandas as pd

from ...costs.hardware import Hardware, parse_rate
from ...costs.spec import ModelSpec
from ...graph import (
    P2P,
    REDUCE,
    W_IN,
)
from ...planner import simulate
from .. import labels
from ..experiments import BASELINE
from .common import (
    DATA_PARALLEL,
    LEGEND,
    PIPELINE,
    _gb,
    lesson_plan,
    policy_label,
    policy_scale,
)


# ---- lesson 4: many GPUs -----------------------------------------------------------------
def wirings(hw: Hardware, p2p: str | None = None) -> dict[str, Hardware]:
    """Three wirings of ``hw``'s GPUs: as the preset has them, with GPU<->GPU
    peer copies on each switch (at ``p2p``, default the host link's rate) and,
    with peer copies, one switch (its own uplink to the host) per GPU."""
    rate = hw.h2d if p2p is None else parse_rate(p2p)
    peer = replace(hw, p2p=hw.p2p or rate, name=f"{hw.name}, P2P")
    given = (
        f"as the preset: {'P2P' if hw.p2p else 'no P2P'}, {hw.gpus_per_switch} GPUs "
        "per switch uplink"
    )
    return {
        given: hw,
        f"P2P, {hw.gpus_per_switch} GPUs per switch uplink": peer,
        "P2P, one uplink per GPU": replace(peer, gpus_per_switch=1, name=f"{hw.name}, own"),
    }


def describe_servers(servers: Mapping[str, Hardware]) -> pd.DataFrame:
    """One row per wiring: GPUs, each GPU's link, how many GPUs share a switch
    uplink and its rate, and GPU<->GPU copies (P2P rate, or through host memory)."""
    return pd.DataFrame(
        [
            {
                "wiring": name,
                "gpus": hw.n_gpus,
                "gpu_link_GBps": hw.h2d / 1e9,
                "gpus_per_uplink": hw.gpus_per_switch,
                "uplink_GBps": hw.uplink / 1e9,
                "gpu_to_gpu": f"P2P {hw.p2p / 1e9:.3g} GB/s" if hw.p2p else "through host memory",
            }
            for name, hw in servers.items()
        ]
    )


def scaling_sweep(
    spec: ModelSpec,
    servers: Mapping[str, Hardware],
    gpu_counts: Sequence[int],
    minibatch: int,
    microbatch: int,
    layers_per_pack: int,
    policies: Sequence[str] = (PIPELINE, DATA_PARALLEL, BASELINE),
) -> pd.DataFrame:
    """Simulated samples/s of each policy on each wiring and GPU count, the same
    packs and microbatches throughout; ``efficiency`` = samples/s over (N x
    samples/s on the fewest GPUs); bytes over host links and between GPUs."""
    rows = []
    for wiring, hw in servers.items():
        for policy in policies:
            for n in sorted(gpu_counts):
                if n > hw.n_gpus:
                    continue
                plan = lesson_plan(policy, spec, hw, n, minibatch, microbatch, layers_per_pack)
                s = simulate(spec, hw, plan).summary
                kinds = s.bytes_by_kind
                rows.append(
                    {
                        "wiring": wiring,
                        "policy": policy_label(policy),
                        "n_gpus": n,
                        "samples_per_s": s.samples_per_s if s.fits else math.nan,
                        "host_gb": _gb(s.swap_bytes),
                        "w_in_gb": _gb(kinds.get(W_IN, 0.0)),
                        "gpu_gpu_gb": _gb(kinds.get(P2P, 0.0) + kinds.get(REDUCE, 0.0)),
                        "fits": s.fits,
                        "limited_by": s.lower_bound_by,
                    }
                )
    df = pd.DataFrame(rows)
    keys = ["wiring", "policy"]
    first = df.groupby(keys)["samples_per_s"].transform("first")
    fewest = df.groupby(keys)["n_gpus"].transform("first")
    df["speedup"] = df["samples_per_s"] / first
    df["efficiency"] = df["speedup"] * fewest / df["n_gpus"]
    return df


def scaling_lesson_chart(df: pd.DataFrame, title: str = ""):
    """Samples/s against GPUs, one panel per wiring, one line per policy."""
    import altair as alt

    counts = sorted(df["n_gpus"].unique().tolist())
    return (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "n_gpus:Q",
                scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=counts),
                title="GPUs",
            ),
            y=alt.Y("samples_per_s:Q", title="samples/s (simulated)"),
            color=alt.Color(
                "policy:N", title="policy", legend=LEGEND, scale=policy_scale(df["policy"])
            ),
            tooltip=labels.tooltips(
                df,
                ["wiring", "policy", "n_gpus", "samples_per_s", "efficiency", "limited_by"],
                {"efficiency": ".2f"},
            ),
        )
        .properties(width=220, height=200)
        .facet(
            column=alt.Column(
                "wiring:N",
                title="how the GPUs are wired",
                sort=list(dict.fromkeys(df["wiring"])),
                header=alt.Header(labelLimit=260),
            )
        )
        .properties(title=title)
    )
