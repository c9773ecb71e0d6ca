"""An explorer's comparison for reading: the baselines, ratios against one of
them, the headline in words and the table (units in the headings, rounded)."""

from __future__ import annotations

import math

import pandas as pd

from ..planner.systems import PLAN_MAKERS
from ..policies import layer_swap, names

#: comparison column -> (heading, number format)
_TABLE_COLUMNS = {
    "policy": ("policy", None),
    "planned_by": ("planned by", None),
    "microbatches": ("uF / uB", None),
    "iteration_s": ("s / iter", "{:.3g}"),
    "samples_per_s": ("samples / s", "{:.3g}"),
    "swap_gb": ("swap GB / iter", "{:.3g}"),
    "disk_gb": ("disk GB / iter", "{:.3g}"),
    "peak_gb": ("peak GB / GPU", "{:.2f}"),
    "speedup_vs_baseline": ("× faster", "{:.2f}"),
    "swap_ratio_vs_baseline": ("× fewer bytes", "{:.2f}"),
    "note": ("why it cannot run", None),
}


def baselines() -> list[str]:
    """The policies a Harmony plan is compared against: every policy that is not Harmony's own."""
    own = set(names(role="harmony"))
    return [n for n in names() if n not in own]


#: a faithful baseline run on the controls' packs, not on its own chooser's plan
ON_THESE_PACKS = " with these packs"


def policy_choices() -> list[str]:
    """What the explorer's policy control offers: every policy (a faithful baseline
    as the system runs it, on its own chooser's plan), then each faithful baseline
    on the controls' packs, a variant named so ("layer-swap with these packs")."""
    return [*names(), *(f"{p}{ON_THESE_PACKS}" for p in PLAN_MAKERS)]


def policy_of(choice: str) -> tuple[str, bool]:
    """``(policy, on_the_controls)`` of a :func:`policy_choices` entry: whether it
    runs the controls' packs (Harmony's policies, the ablations, the variants) or
    its own chooser's plan (the faithful baselines by their names)."""
    if choice.endswith(ON_THESE_PACKS):
        return choice.removesuffix(ON_THESE_PACKS), True
    return choice, choice not in PLAN_MAKERS


def default_baseline() -> str:
    """What the paper compares against: GPU memory virtualized one layer at a
    time, as vDNN and LMS do (:mod:`harmony.policies.layer_swap`), on its own
    plan. Harmony without input-batch grouping is an ablation, another row."""
    return layer_swap.NAME


#: swap volume per iteration below which a plan swaps next to nothing (model parallel
#: moves only its inputs): a ratio against it would read as 645747x fewer bytes
NO_SWAP_GB = 1e-3


def versus(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """``df`` with ``speedup_vs_baseline`` (the baseline's time / each row's) and
    ``swap_ratio_vs_baseline`` (the baseline's swap volume / each row's; NaN for a
    row that swaps next to nothing, :data:`NO_SWAP_GB`)."""
    base = df[df.policy == baseline]
    t, gb = (base.iteration_s.iloc[0], base.swap_gb.iloc[0]) if len(base) else (math.nan, math.nan)
    return df.assign(
        speedup_vs_baseline=t / df.iteration_s,
        swap_ratio_vs_baseline=gb / df.swap_gb.where(df.swap_gb >= NO_SWAP_GB),
    )


def times(ratio: float, more: str, less: str) -> str:
    """2.96 -> "3x <more>", 0.5 -> "2x <less>"."""
    if not math.isfinite(ratio) or ratio <= 0:
        return f"no comparable {more.split()[-1]}"
    return f"{ratio:.2g}x {more}" if ratio >= 1 else f"{1 / ratio:.2g}x {less}"


def headline(comparison: pd.DataFrame, chosen: str, baseline: str) -> str:
    """E.g. "harmony-pp: 3.1 s/iter, 5.63 GB swapped: 2.1x faster and 3x fewer
    bytes than layer-swap", from an explorer's comparison."""
    rows = comparison.set_index("policy")
    me = rows.loc[chosen]
    if math.isnan(me.iteration_s):
        return f"{chosen}: {me.status}"
    swapped = "next to nothing" if me.swap_gb < NO_SWAP_GB else f"{me.swap_gb:.3g} GB"
    text = f"{chosen}: {me.iteration_s:.3g} s/iter, {swapped} swapped"
    if not me.fits:
        return f"{text}, {me.status}"
    base = rows.loc[baseline] if baseline in rows.index and baseline != chosen else None
    if base is not None and math.isnan(base.iteration_s):
        text += f"; {baseline}: {base.status}"
    elif base is not None:
        faster = times(base.iteration_s / me.iteration_s, "faster", "slower")
        text += (
            f": {faster} than {baseline}"
            if me.swap_gb < NO_SWAP_GB
            else f": {faster} and {times(base.swap_gb / me.swap_gb, 'fewer bytes', 'more bytes')} "
            f"than {baseline}"
        ) + ("" if base.fits else f" (which {base.status.replace(':', ',', 1)})")
    fitting = rows[rows.fits.astype(bool)].sort_values("iteration_s")
    if (
        len(fitting)
        and fitting.index[0] != chosen
        and fitting.iloc[0].iteration_s < me.iteration_s
    ):
        text += (
            f"; fastest that fits: {fitting.index[0]} at {fitting.iloc[0].iteration_s:.3g} s/iter"
        )
    return text


def _microbatches(f: float, b: float) -> str:
    return "–" if math.isnan(b) else f"{f:.0f} / {b:.0f}"


def comparison_table(comparison: pd.DataFrame, baseline: str = ""):
    """A pandas Styler of an explorer's comparison: units in the headings,
    rounded, the chosen row in bold, plans that do not fit in grey, notes wrapped."""
    df = comparison.assign(
        microbatches=[
            _microbatches(f, b)
            for f, b in zip(comparison.fwd_microbatch, comparison.bwd_microbatch)
        ]
    )
    # a column with nothing in it goes, e.g. the ratios when the baseline did not run,
    # or the disk's bytes when no plan has state on disk
    df = df[[c for c in _TABLE_COLUMNS if c in df]].dropna(axis=1, how="all")
    if "disk_gb" in df and not (df["disk_gb"] > 0).any():
        df = df.drop(columns="disk_gb")
    if "note" in df:
        df["note"] = df["note"].fillna("")
    headings = {c: h for c, (h, _) in _TABLE_COLUMNS.items()}
    formats = {headings[c]: f for c, (_, f) in _TABLE_COLUMNS.items() if f and c in df}
    chosen, fits = comparison["chosen"].to_numpy(), comparison["fits"].to_numpy()

    def row_style(row):
        style = "font-weight: bold; background-color: #eef3fb;" if chosen[row.name] else ""
        return [style + ("" if fits[row.name] else "color: #888;")] * len(row)

    caption = (
        f"Every policy on the controls' packs, or a baseline on its own plan; × faster and "
        f"× fewer bytes are against {baseline} (– where a plan swaps next to nothing). Grey rows "
        "do not fit in GPU memory or cannot run."
    )
    if "disk_gb" in df:
        caption += " Swap GB are bytes between host and GPUs; disk GB, between host and disk."
    styler = (
        df.rename(columns=headings)
        .style.format(formats, na_rep="–")
        .apply(row_style, axis=1)
        .hide(axis="index")
        .set_caption(caption)
        .set_table_styles(
            [
                # as wide as the output, no wider: each column as wide as its content needs
                # (JupyterLab fixes the layout: equal columns), the notes wrap to what is left
                {
                    "selector": "",
                    "props": "table-layout: auto; width: 100%; max-width: 100%; font-size: 12px;",
                },
                {
                    "selector": "caption",
                    "props": "caption-side: top; text-align: left; color: #555;",
                },
                # headings wrap between words, so that the numbers' columns stay narrow
                {"selector": "th", "props": "text-align: right; white-space: normal;"},
            ]
        )
    )
    # numbers stay on one line; the notes wrap, so the table stays within the cell
    numbers = [headings[c] for c in df if c != "note"]
    styler = styler.set_properties(subset=numbers, **{"white-space": "nowrap"})
    if "note" in df:
        styler = styler.set_properties(
            subset=[headings["note"]],
            **{"white-space": "normal", "text-align": "left", "min-width": "16em"},
        )
    return styler
