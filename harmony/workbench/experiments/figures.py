"""Charts of the experiments' tables (altair; drawn with the project's palette)."""

from __future__ import annotations

import math

import pandas as pd

from ..charts import bar_chart


def swap_volume_chart(df: pd.DataFrame, title: str = ""):
    names = {
        "harmony_swap_gb": "Harmony (fastest plan)",
        "harmony_pp_swap_gb": "Harmony-PP (fastest)",
        "harmony_min_swap_gb": "Harmony (least swap)",
        "baseline_swap_gb": "virtual memory (fastest)",
    }
    long = df.melt(
        id_vars=["model", "minibatch"],
        value_vars=list(names),
        var_name="system",
        value_name="swap_GB",
    )
    long["system"] = long["system"].map(names)
    long["case"] = long["model"] + " / " + long["minibatch"].astype(str)
    return bar_chart(
        long.dropna(subset=["swap_GB"]),
        "case",
        "swap_GB",
        "system",
        title=title,
        log=True,
        y_title="host<->GPU GB per iteration (log)",
    )


def throughput_chart(long: pd.DataFrame, title: str = ""):
    df = long.assign(case=long["model"] + " / " + long["minibatch"].astype(str)).dropna(
        subset=["samples_per_s"]
    )
    return bar_chart(
        df[["case", "policy", "samples_per_s", "plan"]],
        "case",
        "samples_per_s",
        "policy",
        title=title,
        y_title="samples/s (simulated)",
    )


def heatmap_chart(df: pd.DataFrame, title: str = ""):
    """Iteration time per (pack size, microbatch); cells that do not fit are grey and labelled."""
    import altair as alt

    df = df.assign(
        label=[
            f"{t:.3g}" if t == t else ("OOM" if s == "out of memory" else "–")
            for t, s in zip(df["iteration_s"], df["status"])
        ]
    )
    base = alt.Chart(df).encode(
        x=alt.X("microbatch:O", title="microbatch size (uF = uB)"),
        y=alt.Y("pack_size:O", title="layers per backward pack", sort="ascending"),
    )
    tooltip = [
        "pack_size",
        "packs",
        "microbatch",
        "iteration_s",
        "peak_memory_gb",
        "swap_gb",
        "status",
    ]
    grey = base.mark_rect(color="#dddddd").encode(
        tooltip=tooltip
    )  # every cell; shows where nothing fits
    cells = base.mark_rect().encode(
        color=alt.Color(
            "iteration_s:Q", title="iteration (s)", scale=alt.Scale(scheme="viridis", reverse=True)
        ),
        tooltip=tooltip,
    )
    lo, hi = df["iteration_s"].min(), df["iteration_s"].max()
    dark = lo + 0.6 * (hi - lo) if hi == hi else math.inf  # label dark cells in white
    text = base.mark_text(fontSize=10).encode(
        text="label:N",
        color=alt.condition(f"datum.iteration_s > {dark}", alt.value("white"), alt.value("black")),
    )
    return (grey + cells + text).properties(
        title=title,
        width=max(240, 48 * df["microbatch"].nunique()),
        height=max(160, 28 * df["pack_size"].nunique()),
    )


def search_time_chart(df: pd.DataFrame, title: str = ""):
    """Search time per model, each bar labelled with the configuration chosen."""
    import altair as alt

    df = df.drop(columns=["plan"], errors="ignore").assign(
        config=[
            f"uF={f} uB={b}, {n} packs" for f, b, n in zip(df["uF"], df["uB"], df["bwd_packs"])
        ]
    )
    base = alt.Chart(df).encode(
        x=alt.X("model:N", sort=None), y=alt.Y("search_s:Q", title="search time (s)")
    )
    return (base.mark_bar() + base.mark_text(dy=-6).encode(text="config:N")).properties(
        title=title, width=max(200, 130 * len(df))
    )


def scaling_chart(df: pd.DataFrame, title: str = ""):
    import altair as alt

    n0 = df["n_gpus"].min()
    ideal = df.assign(
        samples_per_s=df.groupby("model")["samples_per_s"].transform("first") * df["n_gpus"] / n0
    )
    x = alt.X(
        "n_gpus:Q",
        title="GPUs",
        scale=alt.Scale(type="log", base=2),
        axis=alt.Axis(values=sorted(df["n_gpus"].unique().tolist())),
    )
    measured = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=x,
            y=alt.Y("samples_per_s:Q", title="samples/s (simulated)", scale=alt.Scale(type="log")),
            color="model:N",
            tooltip=["model", "n_gpus", "policy", "plan", "samples_per_s", "efficiency"],
        )
    )
    linear = (
        alt.Chart(ideal)
        .mark_line(strokeDash=[4, 4], opacity=0.5)
        .encode(x=x, y="samples_per_s:Q", color="model:N")
    )
    eff = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=x,
            y=alt.Y("efficiency:Q", title="scaling efficiency", scale=alt.Scale(domain=[0, 1.1])),
            color="model:N",
        )
    )
    return alt.hconcat(
        (measured + linear).properties(title=title or "throughput (dashed: linear)"),
        eff.properties(title="throughput_N / (N x throughput_1)"),
    )


def fidelity_chart(df: pd.DataFrame, title: str = ""):
    """Measured against simulated, time and peak memory, with the y = x line."""
    import altair as alt

    ran = df[df.status == "ran"]

    def scatter(x: str, y: str, label: str):
        top = float(max(ran[x].max(), ran[y].max())) * 1.1
        line = (
            alt.Chart(pd.DataFrame({"v": [0.0, top]}))
            .mark_line(color="gray", strokeDash=[4, 4])
            .encode(
                x=alt.X("v:Q", title=f"simulated {label}"),
                y=alt.Y("v:Q", title=f"measured {label}"),
            )
        )
        dots = (
            alt.Chart(ran)
            .mark_circle(size=80)
            .encode(
                x=f"{x}:Q",
                y=f"{y}:Q",
                color=alt.Color("layers_per_pack:O", title="layers per pack"),
                shape=alt.Shape("microbatch:O"),
                tooltip=list(ran.columns),
            )
        )
        return (line + dots).properties(width=260, height=260, title=label)

    return alt.hconcat(
        scatter("simulated_s", "measured_s", "iteration time (s)"),
        scatter("simulated_peak_mb", "measured_peak_mb", "peak memory (MB)"),
    ).properties(title=title)


def systems_chart(df: pd.DataFrame, title: str = ""):
    """Samples/s of every system, one group of bars per model and minibatch."""
    long = df.assign(case=[f"{m}, B={b}" for m, b in zip(df.model, df.minibatch)])
    return bar_chart(
        long, "case", "samples_per_s", color="policy", title=title, y_title="samples/s (simulated)"
    )


def torch_offload_chart(df: pd.DataFrame, title: str | list[str] = ""):
    """Samples/s of Harmony and of PyTorch's own offload, side by side."""
    return bar_chart(
        df[df.status == "ran"],
        "system",
        "samples_per_s",
        title=title,
        y_title="samples/s (measured)",
    )
