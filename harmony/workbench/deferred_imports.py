"""Imports that cost seconds and are rarely used, made when first used.

Altair validates charts with ``jsonschema``, whose format checkers import
``rfc3987_syntax`` where it is installed (JupyterLab's ``jupyter-events``
installs it). That module compiles an Earley grammar at import time: about
2.4 s of CPU in every process that draws a chart (a notebook's kernel, a
test's subprocess), for a check of "iri" string formats that no chart
schema here asks for. :func:`defer_iri_grammar` puts a stand-in in its place
that imports the real module the first time a format is checked, so nothing
is lost but the wait.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

IRI_MODULE = "rfc3987_syntax"


def defer_iri_grammar() -> None:
    """Let ``rfc3987_syntax`` be imported at its first use, not with jsonschema."""
    if IRI_MODULE in sys.modules:
        return
    spec = importlib.util.find_spec(IRI_MODULE)
    if spec is None:
        return
    stand_in = types.ModuleType(IRI_MODULE)
    # the real module's spec: importlib.util.find_spec(IRI_MODULE), which raises for a
    # module in sys.modules without one, answers as before
    stand_in.__spec__ = spec

    def is_valid_syntax(*args, **kwargs):
        if sys.modules.get(IRI_MODULE) is stand_in:
            del sys.modules[IRI_MODULE]  # the real module from here on
        return importlib.import_module(IRI_MODULE).is_valid_syntax(*args, **kwargs)

    stand_in.is_valid_syntax = is_valid_syntax
    sys.modules[IRI_MODULE] = stand_in
