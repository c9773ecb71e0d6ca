"""Copies paced to the bandwidth of the links they cross, for an emulated GPU's
links and an emulated disk. A leaf: the storage tiers and the devices above
them both use it."""

from __future__ import annotations

import threading
import time


class LinkPacer:
    """Paces copies to the bandwidth of the links on their route, shared by every
    emulated GPU of a server. Each link is a queue of work: a copy of n bytes
    takes n / bandwidth of each link on its route, after the work already
    queued there, and ends when its slowest link is done (and no sooner than
    its own rate cap allows); its thread sleeps until then. A shared uplink
    therefore carries at most its bandwidth, while copies that are slow for
    other reasons share it."""

    def __init__(self, links: dict[str, float]):
        self.bandwidth = dict(links)
        self.free_at = {link: 0.0 for link in links}
        self._lock = threading.Lock()

    def wait(
        self, route: tuple[str, ...], nbytes: float, max_rate: float, started: float
    ) -> float:
        """Sleep until a copy of ``nbytes`` that ``started`` (``time.perf_counter()``)
        on ``route`` is done; returns that time (``started`` when nothing is paced)."""
        if not route or nbytes <= 0:
            return started
        with self._lock:
            end = started + nbytes / max_rate
            for link in route:
                done = max(started, self.free_at[link]) + nbytes / self.bandwidth[link]
                self.free_at[link] = done
                end = max(end, done)
        left = end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return end
