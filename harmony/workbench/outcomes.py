"""What ``harmony reproduce`` reports: one :class:`Outcome` per claim, its verdict
against the paper's number, the summary table and ``summary.md`` / ``summary.json``."""

from __future__ import annotations

import json
import math
import string
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

#: ours within this share of the paper's number (or beyond it) is "reproduced", within
#: twice that "partly"
CLOSE = 0.25


@dataclass
class Outcome:
    name: str
    claim: str
    paper: str
    ours: str  # our number, formatted
    status: str  # ok / failed / skipped
    seconds: float
    mode: str  # quick / full
    error: str = ""
    run_dir: str = ""
    files: list[str] = field(default_factory=list)
    target: float | None = None
    better: str = "higher"
    gap: str = ""
    of: str = ""  # a further claim of this experiment's run (its time is the experiment's)

    @property
    def verdict(self) -> str:
        """reproduced / partly / not reproduced against the paper's number, or "-"."""
        try:
            ours = float(self.ours)
        except ValueError:
            return "-"
        if self.target is None or self.status == "failed" or math.isnan(ours):
            return "-"
        t = self.target
        if self.better == "higher":
            share = ours / t if t else math.inf
        elif self.better == "lower":
            share = 1.0 if ours <= t else (t / ours if ours else 0.0)
        else:
            share = 1.0 - abs(ours - t) / abs(t) if t else float(ours == t)
        if share >= 1.0 - CLOSE:
            return "reproduced"
        return "partly" if share >= 1.0 - 2 * CLOSE else "not reproduced"


@dataclass
class Report:
    """What :func:`~.reproduce.reproduce` did, one :class:`Outcome` per experiment."""

    outcomes: list[Outcome]

    @property
    def failures(self) -> list[str]:
        return [o.name for o in self.outcomes if o.status == "failed" and not o.of]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        """0 when every experiment ran (or was up to date), 1 when any failed."""
        return 0 if self.ok else 1

    def table(self) -> str:
        return _table(self.outcomes)

    def __bool__(self) -> bool:  # truthy when all went well
        return self.ok


def _table(outcomes: Sequence[Outcome], markdown: bool = False) -> str:
    head = ["experiment", "paper", "ours", "verdict", "ran", "time"]
    rows = [
        [
            o.name,
            o.paper,
            o.ours,
            o.verdict,
            o.status,
            f"with {o.of}" if o.of else f"{o.seconds:.1f} s",
        ]
        for o in outcomes
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        claims = [
            f"- **{o.name}** ({o.mode}): {o.claim}"
            + (
                f" **Verdict: {o.verdict}.** {o.gap}"
                if o.verdict not in ("-", "reproduced")
                else ""
            )
            + (f" — failed: {o.error}" if o.error else "")
            for o in outcomes
        ]
        return "\n".join(lines + [""] + claims) + "\n"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:{w}s}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*r) for r in rows
    ]
    for o in outcomes:
        if o.status == "failed" and not o.of:
            lines.append(f"FAILED {o.name}: {o.error} (see {o.run_dir})")
    return "\n".join(lines)


def _lookup(results: dict, path: str) -> Any:
    value: Any = results
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _format(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def _results(run_dir: Path) -> dict:
    """The run's ``results.json`` ({} when it has none or cannot be read)."""
    try:
        return json.loads((run_dir / "results.json").read_text())
    except (ValueError, OSError):
        return {}


def _our_number(summary: str, results: dict) -> str:
    return _format(_lookup(results, summary))


class _Gap(string.Formatter):
    """Fills a gap sentence's ``{dotted.path:format}`` fields from ``results.json``."""

    def __init__(self, results: dict):
        self.results = results

    def get_field(self, field_name, args, kwargs):
        return _lookup(self.results, field_name), field_name

    def format_field(self, value, format_spec):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "n/a"
        return format(value, format_spec)


def fill_gap(gap: str, results: dict) -> str:
    """``gap`` with each ``{field:format}`` replaced by that field of ``results``
    ("n/a" where the run has none)."""
    try:
        return _Gap(results).format(gap)
    except (ValueError, TypeError) as e:  # a malformed template is shown as written
        return f"{gap} (gap template: {e})"


def _portable(path: str) -> str:
    """``path`` relative to the working directory where it lies under it: a summary
    committed with the figures names no folder of the machine that made it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _write_summary(out: Path, outcomes: list[Outcome]) -> None:
    """Merge this run's outcomes into ``out/summary.json`` and rewrite ``summary.md``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    merged: dict[str, dict] = {}
    if path.exists():
        try:
            merged = {d["name"]: d for d in json.loads(path.read_text())}
        except (ValueError, KeyError, TypeError):
            merged = {}
    for o in outcomes:
        merged[o.name] = {
            **{k: v for k, v in asdict(o).items() if k != "files"},
            "run_dir": _portable(o.run_dir),
            "verdict": o.verdict,
        }
    rows = [merged[k] for k in sorted(merged)]
    path.write_text(json.dumps(rows, indent=2) + "\n")
    known = {f.name for f in fields(Outcome)}
    outcomes = [Outcome(**{k: v for k, v in r.items() if k in known}) for r in rows]
    (out / "summary.md").write_text(_table(outcomes, markdown=True))
