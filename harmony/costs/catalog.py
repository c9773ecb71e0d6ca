"""Model specs by name, from the reference profiles or the analytic zoo."""

from __future__ import annotations

from ..errors import HarmonyError
from . import reference, zoo
from .spec import ModelSpec

SOURCES = ("auto", "reference", "zoo")


def known_models() -> list[str]:
    return sorted(set(reference.VARIANTS) | set(zoo.MODELS))


def model_spec(name: str, source: str = "auto") -> ModelSpec:
    """The cost model of ``name``.

    ``auto`` prefers the GTX 1080 Ti measurements (the paper's numbers) and
    falls back to the analytic zoo; ``reference`` / ``zoo`` insist on one."""
    if source not in SOURCES:
        raise HarmonyError(f"unknown spec source {source!r}; use one of {SOURCES}")
    if source in ("auto", "reference") and name in reference.VARIANTS:
        return reference.load(name)
    if source == "reference":
        raise HarmonyError(
            f"no reference profile for {name!r}; profiled: {', '.join(reference.VARIANTS)}"
        )
    if name in zoo.MODELS:
        return zoo.spec(name)
    raise HarmonyError(f"unknown model {name!r}; known models: {', '.join(known_models())}")
