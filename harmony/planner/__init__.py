"""The planner: which plan to run. The search (:mod:`.search`) ranks plans of
Harmony's placements by simulation; every other system chooses its plan by its
own stated rule (:mod:`.systems`); :func:`plan_for` gives any policy's best
plan. Packing estimates (:mod:`.packing`) and KARMA's performance model
(:mod:`.karma`) only steer the candidates: the simulator decides what fits.
:func:`simulate` is the one-line build-and-play of a plan."""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..plan import Plan
from ..policies import build_graph
from ..simulate import gc_paused, simulate_graph
from ..trace import Trace
from .search import search
from .systems import CHOOSERS, plan_for, plans_for

__all__ = ["CHOOSERS", "plan_for", "plans_for", "search", "simulate"]


def simulate(spec: ModelSpec, hardware: Hardware, plan: Plan) -> Trace:
    """Build ``plan``'s task graph for ``spec`` on ``hardware`` and play it."""
    with gc_paused():
        return simulate_graph(build_graph(spec, hardware, plan))
