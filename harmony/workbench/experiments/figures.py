"""Charts of the experiments' tables (altair; drawn with the project's palette)."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from .. import labels, palette
from ..charts import bar_chart
from .settings import ABLATION, BASELINES, HARMONY_POLICIES

#: the systems of :func:`~.paper_grid.paper_grid` the charts show: system -> (label, policy
#: whose colour it takes)
_SHOWN = {
    "harmony": ("Harmony, fastest plan", "harmony-pp"),
    "harmony (least swap)": ("Harmony, least-swap plan", "harmony-dp"),
    "harmony-pp": ("harmony-pp", "harmony-pp"),
    "harmony-dp": ("harmony-dp", "harmony-dp"),
    **{b: (b, b) for b in BASELINES},
    ABLATION: (f"{ABLATION} (ablation)", ABLATION),
}


def system_bars(
    df: pd.DataFrame,
    y: str,
    systems: Sequence[str],
    title: str = "",
    log: bool = False,
    y_title: str | None = None,
):
    """Bars of ``y`` per case (model / minibatch), one per system of ``systems``
    (rows of :func:`~.paper_grid.paper_grid` that fit), each labelled as in
    :data:`_SHOWN` and in its policy's colour: the ablation apart from the baselines."""
    rows = df[df["system"].isin(systems) & df["fits"].astype(bool)].dropna(subset=[y])
    rows = rows.assign(
        case=[labels.case_label(m, b) for m, b in zip(rows["model"], rows["minibatch"])],
        system=rows["system"].map(lambda s: _SHOWN[s][0]),
    )
    shown = [_SHOWN[s][0] for s in systems if _SHOWN[s][0] in set(rows["system"])]
    colors = {_SHOWN[s][0]: palette.color(_SHOWN[s][1]) for s in systems}
    return bar_chart(
        rows[["case", "system", y, "plan", "microbatch"]],
        "case",
        y,
        "system",
        title=title,
        log=log,
        y_title=y_title,
        x_title="model and minibatch",
        scale={"domain": shown, "range": [colors[s] for s in shown]},
    )


def swap_volume_chart(grid: pd.DataFrame, title: str = ""):
    """Host<->GPU GB per iteration (log) of Harmony's fastest and least-swap plans,
    the faithful baselines and the ablation, per model and minibatch."""
    systems = ["harmony", "harmony (least swap)", *BASELINES, ABLATION]
    return system_bars(
        grid, "swap_gb", systems, title, log=True, y_title="host<->GPU GB per iteration (log)"
    )


def throughput_chart(grid: pd.DataFrame, title: str = ""):
    """Simulated samples/s of each Harmony placement, the faithful baselines and the ablation."""
    systems = [*HARMONY_POLICIES, *BASELINES, ABLATION]
    return system_bars(grid, "samples_per_s", systems, title, y_title="samples/s (simulated)")


def ladder_chart(ladder: pd.DataFrame, title: str = ""):
    """The ablation ladder per model: seconds per iteration of each rung (top)
    and its PCIe GB per iteration (bottom), bottom rung to Harmony left to right."""
    import altair as alt

    rows = ladder[ladder["rung"].notna()].assign(
        step=lambda d: d["rung"].astype(int).astype(str) + " " + d["technique"]
    )
    order = list(dict.fromkeys(rows.sort_values("rung")["step"]))
    rows = rows.assign(model=rows["model"].map(labels.model_label))
    base = alt.Chart(rows).encode(
        x=alt.X(
            "step:N",
            sort=order,
            title="rung: the technique it adds",
            axis=alt.Axis(labelAngle=-35, labelAlign="right", labelLimit=260),
        ),
        color=alt.Color(
            "policy:N",
            title="policy",
            scale=alt.Scale(**palette.series_scale(rows["policy"])),
            legend=alt.Legend(orient="bottom"),
        ),
        tooltip=labels.tooltips(
            rows,
            [
                "model",
                "rung",
                "technique",
                "how",
                "plan",
                "microbatch",
                "iteration_s",
                "speedup_vs_previous",
                "speedup_vs_bottom",
                "host_gpu_gb",
                "gpu_gpu_gb",
            ],
        ),
    )
    time = base.mark_bar().encode(
        x=alt.X("step:N", sort=order, axis=None),  # the panel below names the rungs
        y=alt.Y("iteration_s:Q", title="s / iteration (simulated)"),
    )
    pcie = base.mark_bar().encode(
        y=alt.Y(
            "pcie_gb:Q", title="PCIe GB / iteration (log)", scale=alt.Scale(type="log"), stack=None
        )
    )
    models = list(dict.fromkeys(rows["model"]))

    def by_model(chart, height: int, labels: bool):
        column = alt.Column("model:N", title="model", sort=models)
        below = alt.Column("model:N", title=None, sort=models, header=alt.Header(labels=False))
        return (
            chart.properties(width=260, height=height)
            .facet(column=column if labels else below)
            .resolve_scale(y="independent")
        )

    # one panel per model, each on its own scale: the models' times differ by 10x
    return alt.vconcat(by_model(time, 170, True), by_model(pcie, 120, False)).properties(
        title=title
    )


def karma_chart(karma: pd.DataFrame, title: str = ""):
    """KARMA's speedup over each per-layer swapping baseline, per model and minibatch."""
    rows = karma.dropna(subset=["karma_speedup"]).assign(
        case=lambda d: [labels.case_label(m, b) for m, b in zip(d["model"], d["minibatch"])]
    )
    return bar_chart(
        rows[["case", "baseline", "karma_speedup", "plan", "karma_plan", "microbatch"]],
        "case",
        "karma_speedup",
        "baseline",
        title=title,
        y_title="baseline time / KARMA's (simulated)",
        x_title="model and minibatch",
        color_title="per-layer swapping baseline",
    )


def hydra_chart(hydra: pd.DataFrame, title: str = ""):
    """Time to train the model-selection jobs: each baseline one model after
    another, and HYDRA's merged schedule on the same jobs."""
    rows = hydra.dropna(subset=["hydra_total_s"])
    long = pd.concat(
        [
            rows.assign(
                system=rows["baseline"] + ", one model after another",
                total_s=rows["baseline_total_s"],
            ),
            rows.assign(system="hydra, merged", total_s=rows["hydra_total_s"]),
        ]
    ).assign(against=lambda d: "vs " + d["baseline"])
    return bar_chart(
        long[["against", "system", "total_s", "jobs", "microbatch"]],
        "against",
        "total_s",
        "system",
        title=title,
        y_title="seconds to train every job (simulated)",
        x_title="HYDRA compared with",
        color_title="schedule",
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
    tooltip = labels.tooltips(
        df,
        ["pack_size", "packs", "microbatch", "iteration_s", "peak_memory_gb", "swap_gb", "status"],
    )
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
    df = df.assign(model=df["model"].map(labels.model_label))
    base = alt.Chart(df).encode(
        x=alt.X("model:N", sort=None, title="model", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("search_s:Q", title="search time (s)"),
        tooltip=labels.tooltips(df, ["model", "search_s", "config"], {"search_s": ".3~g"}),
    )
    return (base.mark_bar() + base.mark_text(dy=-6).encode(text="config:N")).properties(
        title=title, width=max(200, 130 * len(df))
    )


def scaling_chart(df: pd.DataFrame, title: str = ""):
    """Throughput against GPUs per model (dashed: linear from the fewest GPUs), and the
    scaling efficiency."""
    import altair as alt

    df = df.assign(model=df["model"].map(labels.model_label))

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
            color=alt.Color("model:N", title="model"),
            tooltip=labels.tooltips(
                df, ["model", "n_gpus", "policy", "plan", "samples_per_s", "efficiency"]
            ),
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
        eff.properties(title="scaling efficiency: throughput on N GPUs / (N x on one)"),
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
                shape=alt.Shape("microbatch:O", title="microbatch size"),
                tooltip=labels.tooltips(ran),
            )
        )
        return (line + dots).properties(width=260, height=260, title=label)

    return alt.hconcat(
        scatter("simulated_s", "measured_s", "iteration time (s)"),
        scatter("simulated_peak_mb", "measured_peak_mb", "peak memory (MB)"),
    ).properties(title=title)


def systems_chart(df: pd.DataFrame, title: str = ""):
    """Samples/s of every system that has a plan, one group of bars per model and minibatch."""
    ran = df[df["fits"].astype(bool)]
    long = ran.assign(case=[labels.case_label(m, b) for m, b in zip(ran.model, ran.minibatch)])
    return bar_chart(
        long[["case", "policy", "samples_per_s", "plan", "microbatch"]],
        "case",
        "samples_per_s",
        color="policy",
        title=title,
        y_title="samples/s (simulated)",
        x_title="model and minibatch",
    )


def torch_offload_chart(df: pd.DataFrame, title: str | list[str] = ""):
    """Samples/s of Harmony and of PyTorch's own offload, side by side."""
    return bar_chart(
        df[df.status == "ran"],
        "system",
        "samples_per_s",
        title=title,
        y_title="samples/s (measured)",
        x_title="system",
    )
