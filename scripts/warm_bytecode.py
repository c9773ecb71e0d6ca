"""Write the bytecode of what the tests, notebooks and CLI import, once, at set-up.

torch goes into the venv without bytecode (``pip --no-compile`` saves a minute
of install), and where ``PYTHONDONTWRITEBYTECODE`` is set no later import writes
it either: then every process that imports torch (each test worker, notebook
kernel, CLI run and spawned trainer) compiles it from source again, about 3 s
of CPU each on a 2-core machine. This imports the heavy modules once and writes
the bytecode of every module it loaded from the venv (never into the checkout:
the variable may be there to keep the source tree clean).

    .venv/bin/python scripts/warm_bytecode.py
"""

from __future__ import annotations

import importlib
import importlib.util
import py_compile
import sys
from pathlib import Path

#: what the suite's processes import: test workers, kernels, CLI runs, torchrun,
#: the browser test's server, and the Hugging Face models the tests decompose
MODULES = [
    "harmony.cli",
    "harmony.workbench.widgets",
    "harmony.engine.hf.layers",
    "torch.distributed.run",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "papermill",
    "nbclient",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "hypothesis",
    "xdist",
    "jupyterlab.labapp",
    "playwright.sync_api",
    "vl_convert",
]


def main() -> None:
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional extra not installed: nothing to warm
            missing.append(f"{name} ({e})")
    venv = Path(sys.prefix).resolve()
    written = 0
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        path = Path(source).resolve()
        if venv not in path.parents:
            continue
        cached = Path(importlib.util.cache_from_source(str(path)))
        if cached.exists() and cached.stat().st_mtime >= path.stat().st_mtime:
            continue
        try:
            py_compile.compile(str(path), cfile=str(cached), doraise=True)
            written += 1
        except (py_compile.PyCompileError, OSError):
            pass  # a file that will not compile or a read-only tree: imports still work
    skipped = f"; not installed: {missing}" if missing else ""
    print(f"bytecode: {written} modules compiled{skipped}")


if __name__ == "__main__":
    main()
