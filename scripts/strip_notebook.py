#!/usr/bin/env python3
"""Git's clean filter for the notebooks (as nbstripout does it): a notebook that was
run and saved in place is committed as it was written, without outputs, execution
counts, run metadata or a cell papermill injected, so running one leaves
``git status`` clean.

    python3 scripts/strip_notebook.py < run.ipynb > clean.ipynb   # the filter
    python3 scripts/strip_notebook.py --install                   # register it in this clone

``.gitattributes`` names the filter for ``*.ipynb``; git's filter settings belong to
each clone, so ``make`` (its ``.venv/.installed`` step) runs ``--install``. Only the
standard library: git runs it with whatever ``python3`` is on the PATH.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: the name ``.gitattributes`` gives the filter
FILTER = "nbstrip"
#: cell metadata a notebook's author sets (everything else is written by a run)
KEEP_CELL_METADATA = ("tags",)
#: the tag of the cell papermill adds with the parameters of a run
INJECTED = "injected-parameters"


def strip(nb: dict) -> dict:
    """``nb`` as committed: no outputs, counts, run metadata or injected cells."""
    cells = []
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {})
        if INJECTED in meta.get("tags", []):
            continue
        cell["metadata"] = {k: meta[k] for k in KEEP_CELL_METADATA if meta.get(k)}
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        cells.append(cell)
    nb["cells"] = cells
    meta = nb.get("metadata", {})
    kept = {}
    if "kernelspec" in meta:
        kept["kernelspec"] = meta["kernelspec"]
    if "language_info" in meta:
        kept["language_info"] = {"name": meta["language_info"].get("name", "python")}
    nb["metadata"] = kept
    return nb


def dumps(nb: dict) -> str:
    """JSON as Jupyter writes notebooks (one-space indent, sorted keys, a final newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def install() -> None:
    """Register the filter in this clone's git config."""
    here = "python3 scripts/strip_notebook.py"
    subprocess.run(["git", "config", f"filter.{FILTER}.clean", here], check=True)
    subprocess.run(["git", "config", f"filter.{FILTER}.smudge", "cat"], check=True)


def main(argv: list[str]) -> int:
    if argv == ["--install"]:
        install()
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    text = sys.stdin.read()
    try:
        nb = json.loads(text)
    except json.JSONDecodeError:  # not a notebook git can read: pass it through untouched
        sys.stdout.write(text)
        return 0
    sys.stdout.write(dumps(strip(nb)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
