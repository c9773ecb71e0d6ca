"""Write the bytecode of what the tests, notebooks and CLI import, once, at set-up.

torch goes into the venv without bytecode (``pip --no-compile`` saves a minute
of install; ``uv`` writes none either), and where ``PYTHONDONTWRITEBYTECODE`` is
set no later import writes it: then every process that imports torch (each test
worker, notebook kernel, CLI run and spawned trainer) compiles it from source
again, about 3 s of CPU each on a 2-core machine (``import torch`` 6.5 s
against 3.9 s). This imports those modules once with bytecode writing on: the
venv's and the checkout's ``__pycache__`` folders (ignored by git) get them.

    .venv/bin/python scripts/warm_bytecode.py
"""

from __future__ import annotations

import importlib
import os
import sys

#: what the suite's processes import: test workers, notebook kernels (the
#: debugger ipykernel loads, the charts' data frames), CLI runs and torchrun
MODULES = [
    "harmony.cli",
    "harmony.workbench.widgets",
    "torch.distributed.run",
    "torch._dynamo",  # imported by torch on the first op on a meta tensor (the zoo's cost model)
    "papermill",
    "ipykernel.kernelapp",
    "ipykernel.debugger",
    "IPython.core.completerlib",
    "IPython.extensions.storemagic",
    "altair.utils.save",
    "narwhals._pandas_like.namespace",
    "pandas.io.formats.style",
    "hypothesis",
    "xdist",
]


def main() -> None:
    sys.dont_write_bytecode = False
    # ipykernel's debugger warns about frozen modules as it loads: not for this import
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    before = len(sys.modules)
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional extra not installed: nothing to warm
            missing.append(f"{name} ({e})")
    skipped = f"; not installed: {missing}" if missing else ""
    print(f"bytecode: written for {len(sys.modules) - before} modules{skipped}")


if __name__ == "__main__":
    main()
