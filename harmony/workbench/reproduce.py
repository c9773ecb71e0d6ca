"""``harmony reproduce``: run the paper's experiments and collect their figures.

Each ``experiments/<name>.yaml`` names a notebook, the paper's claim, the
field of the notebook's ``results.json`` that holds our number (``summary``,
a dotted path), and two parameter sets, ``quick`` (CPU, seconds to minutes)
and ``full`` (the paper's set). :func:`reproduce` executes the chosen
experiments with papermill, one after the other:

* the executed notebook and everything it writes (``out_dir`` is set to the
  run folder) go to ``experiments/runs/<name>/``;
* its figures and data are copied to ``<out>/<name>.{svg,png,csv}`` (the
  notebook's ``figure`` and ``data``; other files as ``<name>_<file>``);
* an experiment whose notebook, parameters and ``harmony`` source are the
  same as in its last successful run is skipped (``force`` runs it anyway);
* a notebook that fails keeps its partial output notebook, is reported, and
  the others still run.

At the end a table (:mod:`.outcomes`) gives, per claim, the paper's number, ours, the
verdict (``reproduced`` when ours is within 25% of the paper's number or
beyond it, ``partly`` within 50%, else ``not reproduced``, with the YAML's
``gap`` sentence saying why; ``-`` where the claim has no number), whether it
ran and the time; it is also written to ``<out>/summary.md`` and
``<out>/summary.json``. An experiment whose notebook checks several claims
lists the others under ``claims`` (each with its own ``label``, ``claim``,
``paper``, ``summary``, ``target``, ``better`` and ``gap``); each gets its row,
``<name>/<label>``. A ``gap`` sentence may name fields of ``results.json``
in braces, with a format (``{max_speedup_no_fixed:.2f}``): they are filled
from the run, so the sentence's numbers are this run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..errors import HarmonyError
from .outcomes import Outcome, Report, _our_number, _results, _write_summary, fill_gap

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # harmony/: its source is hashed
ROOT = PACKAGE_DIR.parent
EXPERIMENTS_DIR = ROOT / "experiments"
KERNEL = "python3"
STAMP = "run.json"  # next to each run: hash, status, time, our number
REQUIRED_KEYS = ("notebook", "claim", "paper", "summary", "quick", "full")
BETTER = ("higher", "lower", "near")


@dataclass(frozen=True)
class Claim:
    """A further claim an experiment's notebook checks (``claims`` in its YAML)."""

    label: str  # short, unique within the experiment: its row is <name>/<label>
    claim: str
    paper: str
    summary: str
    target: float | None = None
    better: str = "higher"
    gap: str = ""


@dataclass(frozen=True)
class Experiment:
    """One ``experiments/<name>.yaml``."""

    name: str
    source: Path  # the YAML file
    notebook: Path  # absolute
    claim: str  # the paper's claim, one line, with its number
    paper: str  # the paper's number, short (table column)
    summary: str  # dotted path of our number in results.json
    quick: dict[str, Any]
    full: dict[str, Any]
    #: the paper's number to hold ours against (None: the claim has no number), whether
    #: more is better ("higher"), less ("lower") or ours should equal it ("near"), and one
    #: sentence with the number that explains a gap
    target: float | None = None
    better: str = "higher"
    gap: str = ""
    claims: tuple[Claim, ...] = ()

    @property
    def root(self) -> Path:
        """The folder relative paths in the YAML start from (the repository)."""
        return self.source.parent.parent

    def params(self, full: bool) -> dict[str, Any]:
        return dict(self.full if full else self.quick)


def load_experiment(path: Path) -> Experiment:
    import yaml

    path = Path(path).resolve()
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise HarmonyError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise HarmonyError(f"{path}: expected a mapping with keys {', '.join(REQUIRED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise HarmonyError(f"{path}: missing key(s) {', '.join(missing)}")
    for mode in ("quick", "full"):
        if not isinstance(data[mode] or {}, dict):
            raise HarmonyError(f"{path}: {mode!r} must be a mapping of notebook parameters")
    return Experiment(
        name=path.stem,
        source=path,
        notebook=(path.parent.parent / data["notebook"]).resolve(),
        claim=str(data["claim"]).strip(),
        paper=str(data["paper"]).strip(),
        summary=str(data["summary"]),
        quick=dict(data["quick"] or {}),
        full=dict(data["full"] or {}),
        target=_target(data),
        better=_better(path, data.get("better", "higher")),
        gap=str(data.get("gap", "")).strip(),
        claims=tuple(_claim(path, c) for c in data.get("claims") or ()),
    )


def _target(data: dict) -> float | None:
    return None if data.get("target") is None else float(data["target"])


def _claim(path: Path, data: Any) -> Claim:
    keys = ("label", "claim", "paper", "summary")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise HarmonyError(f"{path}: each of claims needs the keys {', '.join(keys)}")
    return Claim(
        label=str(data["label"]),
        claim=str(data["claim"]).strip(),
        paper=str(data["paper"]).strip(),
        summary=str(data["summary"]),
        target=_target(data),
        better=_better(path, data.get("better", "higher")),
        gap=str(data.get("gap", "")).strip(),
    )


def _better(path: Path, better: Any) -> str:
    if better not in BETTER:
        raise HarmonyError(f"{path}: better must be one of {', '.join(BETTER)}, got {better!r}")
    return better


def load_experiments(directory: Path | None = None) -> dict[str, Experiment]:
    """Every experiment in ``directory`` (default: the repository's ``experiments/``), by name."""
    directory = Path(directory or EXPERIMENTS_DIR)
    return {p.stem: load_experiment(p) for p in sorted(directory.glob("*.yaml"))}


def select(experiments: dict[str, Experiment], names: Sequence[str] | None) -> list[Experiment]:
    """The experiments named (exact name or a unique prefix such as ``"10"``), in order; all if
    None."""
    if not names:
        return list(experiments.values())
    chosen = []
    for name in names:
        hits = [e for n, e in experiments.items() if n == name] or [
            e for n, e in experiments.items() if n.startswith(name)
        ]
        if len(hits) != 1:
            why = "matches several" if hits else "is not one of"
            raise HarmonyError(
                f"experiment {name!r} {why} the experiments: {', '.join(experiments)}"
            )
        if hits[0] not in chosen:
            chosen.append(hits[0])
    return chosen


def list_experiments(directory: Path | None = None) -> str:
    """One line per experiment: name, notebook, the paper's claim."""
    return "\n".join(
        f"{e.name:24s} {e.notebook.name:28s} {e.claim}"
        for e in load_experiments(directory).values()
    )


# ---- what makes a run the same run ---------------------------------------------------
@lru_cache(maxsize=None)
def _package_hash(package_dir: Path = PACKAGE_DIR) -> str:
    h = hashlib.sha256()
    for p in sorted(package_dir.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            h.update(str(p.relative_to(package_dir)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def source_hash() -> str:
    """Hash of the ``harmony`` source: results computed under another are stale."""
    return _package_hash()


def run_hash(exp: Experiment, params: dict[str, Any], kernel_name: str = KERNEL) -> str:
    """Hash of the notebook file, its parameters, the kernel and the ``harmony`` source."""
    h = hashlib.sha256()
    h.update(exp.notebook.read_bytes())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    h.update(kernel_name.encode())
    h.update(_package_hash().encode())
    return h.hexdigest()


# ---- further claims --------------------------------------------------------------------
def further_claims(exp: Experiment, outcome: Outcome) -> list[Outcome]:
    """The outcomes of ``exp``'s further claims (``claims`` in its YAML) from the
    same run as ``outcome``."""
    results = _results(Path(outcome.run_dir))
    return [
        Outcome(
            name=f"{exp.name}/{c.label}",
            claim=c.claim,
            paper=c.paper,
            ours=_our_number(c.summary, results),
            status=outcome.status,
            seconds=outcome.seconds,
            mode=outcome.mode,
            error=outcome.error,
            run_dir=outcome.run_dir,
            target=c.target,
            better=c.better,
            gap=fill_gap(c.gap, results),
            of=exp.name,
        )
        for c in exp.claims
    ]


# ---- running ---------------------------------------------------------------------------
def _copy_outputs(exp: Experiment, run_dir: Path, out: Path) -> list[str]:
    """Figures and data of a run into ``out``: ``figure.*`` and ``data.csv`` as
    ``<name>.*``, other SVG/PNG/CSV files as ``<name>_<file>``."""
    out.mkdir(parents=True, exist_ok=True)
    kinds = (".svg", ".png", ".csv")
    for old in list(out.glob(f"{exp.name}.*")) + list(out.glob(f"{exp.name}_*")):
        if old.suffix in kinds and old.is_file():
            old.unlink()
    copied = []
    for src in sorted(run_dir.iterdir()):
        if not src.is_file() or src.suffix not in kinds:
            continue
        stem = exp.name if src.stem in ("figure", "data") else f"{exp.name}_{src.stem}"
        dst = out / f"{stem}{src.suffix}"
        shutil.copyfile(src, dst)
        copied.append(str(dst))
    return copied


def _error_text(e: BaseException) -> str:
    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    text = f"{ename}: {evalue}" if ename else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:300]


def check_kernel(kernel_name: str = KERNEL) -> str | None:
    """A warning if the Jupyter kernel ``kernel_name`` would not run this Python
    (notebooks then may not import this ``harmony``); None if it does."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError:
        return "jupyter_client is not installed: pip install -e '.[notebooks]'"
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        return f"no Jupyter kernel named {kernel_name!r}: pip install ipykernel"
    exe = spec.argv[0] if spec.argv else ""
    if exe in (
        "python",
        f"python{sys.version_info[0]}",
        f"python{sys.version_info[0]}.{sys.version_info[1]}",
    ):
        return None  # jupyter_client starts this very interpreter
    if Path(exe).resolve() != Path(sys.executable).resolve():
        return (
            f"Jupyter kernel {kernel_name!r} runs {exe}, not this Python ({sys.executable}); "
            "notebooks may not find harmony"
        )
    return None


@lru_cache(maxsize=None)
def kernel_manager_class() -> type:
    """The kernel manager batch runs use: its kernels listen on local (IPC)
    sockets in the private Jupyter runtime folder instead of TCP ports, so
    ipykernel has no unencrypted TCP traffic to warn about ("Kernel is
    running over TCP without encryption", once per notebook) and nothing else
    on the machine can reach them. Windows has no IPC transport: TCP there."""
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir

    class LocalKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            if os.name != "nt":
                runtime = Path(jupyter_runtime_dir())
                runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
                # short: a socket path has to fit in about 100 bytes
                ip = str(runtime / f"k-{uuid.uuid4().hex[:12]}")
                kwargs = {"transport": "ipc", "ip": ip, **kwargs}
            super().__init__(**kwargs)

    return LocalKernelManager


def run_experiment(
    exp: Experiment,
    full: bool,
    out: Path,
    runs_dir: Path,
    force: bool = False,
    kernel_name: str = KERNEL,
    timeout: float | None = None,
) -> Outcome:
    """Run (or skip) one experiment; never raises for a failing notebook."""
    mode = "full" if full else "quick"
    run_dir = (runs_dir / exp.name).resolve()
    base = dict(
        name=exp.name,
        claim=exp.claim,
        paper=exp.paper,
        mode=mode,
        run_dir=str(run_dir),
        target=exp.target,
        better=exp.better,
        gap=fill_gap(exp.gap, {}),  # filled from the run once it has results
    )
    params = exp.params(full)
    try:
        digest = run_hash(exp, params, kernel_name)
    except OSError as e:
        return Outcome(**base, ours="n/a", status="failed", seconds=0.0, error=_error_text(e))
    if not force and (done := _done_before(exp, run_dir, out, digest, base)) is not None:
        return done
    seconds, error = _execute(exp, run_dir, params, kernel_name, timeout)
    status = "failed" if error else "ok"
    files = [] if error else _copy_outputs(exp, run_dir, out)
    results = _results(run_dir)
    ours = _our_number(exp.summary, results)
    base["gap"] = fill_gap(exp.gap, results)
    (run_dir / STAMP).write_text(
        json.dumps(
            {
                "hash": digest,
                "status": status,
                "mode": mode,
                "params": params,
                "seconds": seconds,
                "ours": ours,
                "error": error,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
            default=str,
        )
    )
    return Outcome(**base, ours=ours, status=status, seconds=seconds, error=error, files=files)


def _done_before(
    exp: Experiment, run_dir: Path, out: Path, digest: str, base: dict
) -> Outcome | None:
    """The "skipped" outcome of a run already done with the same code and parameters
    (its stamp has this ``digest``, status ok, and it left results), else None."""
    stamp_path = run_dir / STAMP
    if not stamp_path.exists():
        return None
    try:
        stamp = json.loads(stamp_path.read_text())
    except ValueError:
        stamp = {}
    if not (
        stamp.get("hash") == digest
        and stamp.get("status") == "ok"
        and (run_dir / "results.json").exists()
    ):
        return None
    results = _results(run_dir)
    return Outcome(
        **{**base, "gap": fill_gap(exp.gap, results)},
        ours=_our_number(exp.summary, results),
        status="skipped",
        seconds=float(stamp.get("seconds", 0.0)),
        files=_copy_outputs(exp, run_dir, out),
    )


def _execute(
    exp: Experiment, run_dir: Path, params: dict, kernel_name: str, timeout: float | None
) -> tuple[float, str]:
    """Run the experiment's notebook into a fresh ``run_dir``: the seconds it took, and
    what went wrong ("" if nothing did)."""
    import papermill as pm

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    error = ""
    try:
        pm.execute_notebook(
            str(exp.notebook),
            str(run_dir / f"{exp.name}.ipynb"),
            parameters={**params, "out_dir": str(run_dir)},
            kernel_name=kernel_name,
            cwd=str(exp.root),
            progress_bar=False,
            log_output=False,
            execution_timeout=timeout,
            kernel_manager_class=kernel_manager_class(),
        )
        if not (run_dir / "results.json").exists():
            error = "the notebook wrote no results.json into out_dir"
    except Exception as e:  # a failing notebook must not stop the others
        error = _error_text(e)
    return time.perf_counter() - t0, error


def reproduce(
    names: list[str] | None,
    full: bool,
    out: Path,
    force: bool = False,
    *,
    experiments_dir: Path | None = None,
    runs_dir: Path | None = None,
    progress: bool = True,
    kernel_name: str = KERNEL,
    timeout: float | None = None,
) -> Report:
    """Run the experiments ``names`` (all if None; a unique prefix such as
    ``"10"`` works) in quick or ``full`` mode, copy their figures and data into
    ``out``, print and return the summary. ``runs_dir`` defaults to
    ``<experiments_dir>/runs``; ``timeout`` is per notebook cell (seconds)."""
    experiments_dir = Path(experiments_dir or EXPERIMENTS_DIR)
    runs_dir = Path(runs_dir or experiments_dir / "runs")
    out = Path(out)
    chosen = select(load_experiments(experiments_dir), names)
    if not chosen:
        raise HarmonyError(f"no experiments in {experiments_dir}")
    warning = check_kernel(kernel_name)
    if warning:
        print(f"harmony reproduce: warning: {warning}", file=sys.stderr)

    from tqdm.auto import tqdm

    outcomes = []
    bar = tqdm(chosen, desc="experiments", unit="exp", disable=not progress, file=sys.stderr)
    for exp in bar:
        bar.set_postfix_str(exp.name)
        o = run_experiment(
            exp, full, out, runs_dir, force=force, kernel_name=kernel_name, timeout=timeout
        )
        outcomes += [o, *further_claims(exp, o)]
        bar.write(
            f"{o.name}: {o.status} ({o.seconds:.1f} s){': ' + o.error if o.error else ''}",
            file=sys.stderr,
        )
    bar.close()
    report = Report(outcomes)
    _write_summary(out, outcomes)
    print(report.table())
    return report
