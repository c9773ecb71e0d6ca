"""What :meth:`~harmony.workbench.widgets.PackExplorer.compute` finds: one plan
played against every other policy, its headline in words and its comparison table."""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd

from ..plan import Plan
from ..trace import Trace
from .comparison import comparison_table, headline
from .play import records


@dataclass
class Exploration:
    """What :meth:`PackExplorer.compute` found."""

    plan: Plan | None  #: None when the model's spec could not be loaded
    trace: Trace | None  #: None when the plan is invalid or too large to simulate
    #: one row per policy: policy, chosen, planned_by ("the controls", or a
    #: baseline's "its own rule"), fwd/bwd microbatch, iteration_s, samples_per_s,
    #: swap_gb (host<->GPU), disk_gb (host<->disk), peak_gb, fits, status ("fits",
    #: "does not fit: ...", "not run:
    #: ..."), note (why a row could not be simulated or fit),
    #: speedup_vs_baseline (the baseline's time / this one's),
    #: swap_ratio_vs_baseline (the baseline's swap volume / this one's)
    comparison: pd.DataFrame
    problem: str | None  #: why the chosen plan cannot run, in words
    baseline: str = ""  #: the policy the ratios compare against
    #: whether the paper's claim applies here, and why (:func:`.claim.setting`)
    setting: str = ""
    #: with the host memory or the disk not the preset's: the server's, and what of the
    #: chosen plan's training state is on disk (:func:`where_state_lives`)
    tiers: str = ""
    #: the chosen row's label: a policy, or a baseline "with these packs"
    chosen: str = ""
    #: what the chosen plan is when it is not the controls' (a baseline's own chooser's),
    #: and why the GPUs are fewer than the control asked for, if they are
    notes: tuple[str, ...] = ()

    @property
    def headlines(self) -> list[str]:
        """The chosen plan's time and swap volume against the baseline's (and
        the fastest policy that fits, when that is another), what plan it is and
        on how many GPUs (when not what the controls say), where its training
        state lives (when the host memory or the disk is set), then the setting."""
        if self.plan is None:
            return [f"nothing to simulate: {self.problem}"]
        numbers = headline(self.comparison, self.chosen or self.plan.policy, self.baseline)
        return [line for line in (numbers, *self.notes, self.tiers, self.setting) if line]

    @property
    def headline(self) -> str:
        """:attr:`headlines` as one text."""
        return ". ".join(self.headlines)

    def table(self):
        """The comparison for reading: units in the headings, rounded, the
        chosen row in bold, plans that do not fit in grey, notes wrapped
        (a pandas Styler)."""
        return comparison_table(self.comparison, self.baseline)

    def message(self) -> str:
        """HTML for a plan that cannot run: the headlines, then the problem in red
        (in the controls' words), no chart."""
        lines = "".join(f"<div>{html.escape(line)}</div>" for line in self.headlines)
        problem = html.escape(self.problem or "")
        return (
            f'<div class="harmony-problem" style="font-size: 14px; line-height: 1.5">'
            f'{lines}<div style="color: #c0392b; margin-top: 6px"><b>Cannot run:</b> '
            f"{problem}</div></div>"
        )

    def to_dict(self) -> dict:
        """JSON-ready: the plan, the problem, the headline, the comparison rows and the
        trace's main numbers."""
        s = self.trace.summary if self.trace is not None else None
        return {
            "plan": self.plan.to_dict() if self.plan else None,
            "problem": self.problem,
            "headline": self.headline,
            "baseline": self.baseline,
            "setting": self.setting,
            "tiers": self.tiers,
            "iteration_s": s and s.iteration_s,
            "swap_bytes": s and s.swap_bytes,
            "disk_bytes": s and s.disk_bytes,
            "peak_memory": s and s.peak_memory,
            "comparison": records(self.comparison),
        }
