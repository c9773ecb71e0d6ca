"""The workbench: what people touch on top of the library. Experiments (one
function per figure, simulated or measured), charts with one palette
(:mod:`.palette`), interactive widgets for JupyterLab, the lessons' helpers
(:mod:`.lessons`), the ``harmony reproduce`` runner, text
reports, ``harmony train`` and PyTorch's own offload recipe as a baseline.
Nothing in :mod:`harmony` below this package imports it."""

from .deferred_imports import defer_iri_grammar

defer_iri_grammar()  # before anything below imports altair
