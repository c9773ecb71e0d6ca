"""The graphs of plans built for the engine's host memory and disk tier, and the
server each is built for: :class:`HostGraphs`."""

from __future__ import annotations

from typing import Sequence

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from .calibrate import calibrate
from .disk_setup import HostSettings, build_for_host


class HostGraphs:
    """Owns the server plans are built on, the graph kept for a first step, the running server.

    The server is the ``given`` hardware, else the ``device`` calibrated; a
    graph built with the engine's own ``settings`` (``plan="auto"`` builds one
    to check that a plan fits) is kept for that plan's first step.
    ``backends``: the engine's devices (their memory may be host memory);
    ``journal``: updates are journaled (safe_updates)."""

    def __init__(
        self,
        device,
        given: Hardware | None,
        settings: HostSettings,
        backends: Sequence,
        journal: bool,
    ):
        self.device, self.given, self.settings = device, given, settings
        self.backends, self.journal = backends, journal
        #: the server the running graph was built for (None: no graph yet)
        self.running: Hardware | None = None
        self._kept: tuple | None = None  # (plan, build's result) not yet run

    def base(self) -> Hardware:
        """The server as given, else calibrated on this machine."""
        return self.given if self.given is not None else calibrate(self.device)

    def before_plan(self, besides: int) -> Hardware:
        """The server before a plan: the budget less ``besides`` (what the process
        holds besides the model; what the devices take of host memory depends on the
        plan), with the disk tier where its bandwidth is known."""
        settings = self.settings
        hw = self.base().with_host_memory(max(1, settings.budget.capacity - besides))
        known = settings.directory is not None and settings.rates is not None
        return hw.with_disk(settings.rates if known else None)

    def kept(self, plan: Plan, settings: HostSettings) -> tuple[TaskGraph, Hardware] | None:
        """The graph last built for ``plan`` with the engine's own settings, if any."""
        if settings is self.settings and self._kept is not None and self._kept[0] == plan:
            return self._kept[1]
        return None

    def build(
        self,
        plan: Plan,
        settings: HostSettings,
        spec: ModelSpec,
        base: Hardware,
        tensors_per_unit: int,
        besides: int,
    ) -> tuple[TaskGraph, Hardware]:
        """:func:`~harmony.engine.disk_setup.build_for_host` of ``plan`` on ``base``;
        kept when built with the engine's own settings."""
        built = build_for_host(
            spec, base, plan, settings, tensors_per_unit, self.journal, besides, self.backends
        )
        if settings is self.settings:
            self._kept = (plan, built)
        return built

    def run(self, plan: Plan, graph: TaskGraph, server: Hardware) -> None:
        """``graph`` (built on ``server``) is the one the next steps run: nothing is kept."""
        self._kept = None
        self.running = server
