"""The bottom of the graph builder: what a policy asks for (:class:`Op`) and the
primitives every part of the builder adds tasks with (:class:`GraphBase`):
buffers, transfers on routes of links, and the priorities (``seq``) that keep
a graph free of deadlock (see :mod:`harmony.graph`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import Activation, Batch, Buffer, Payload, Task
from ..plan import Plan

HOST = "host"
#: steps between the priorities :meth:`GraphBase._next_seq` hands out: the room just
#: before and just after each transfer and update, where the disk tier's reads and
#: writes of the state it needs go (:mod:`.disk_tier`)
SEQ_ROOM = 4


@dataclass(slots=True)
class Op:
    """One compute task the policy wants: ``kind`` of pack ``pack`` on ``samples``.
    Not frozen, though nothing changes one once made: a plan has hundreds of ops, made
    for its graph and for its compute bound, and a frozen dataclass sets each field
    through ``object.__setattr__``, which made an op many times slower to make."""

    kind: str  # FWD, BWD or FWDBWD
    gpu: int
    pack: int  # index into plan.fwd_packs (FWD) or plan.bwd_packs (BWD, FWDBWD)
    layers: tuple[int, int]
    samples: tuple[int, int]
    microbatch: int
    group: tuple  # ops with equal group on one GPU, back to back, share one weight load
    offload_output: bool = False  # send the output through host memory


class GraphBase:
    """Tasks, buffers and links of one graph under construction, and the
    primitives that add them."""

    def __init__(self, spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0):
        if plan.n_gpus > hw.n_gpus:
            raise HarmonyError(
                f"plan uses {plan.n_gpus} GPUs but hardware {hw.name!r} has {hw.n_gpus}"
            )
        plan.validate(len(spec))
        self.spec, self.hw, self.plan, self.model = spec, hw, plan, model
        self.tasks: list[Task] = []
        self.buffers: list[Buffer] = []
        self.links: dict[str, float] = {}
        for g in range(plan.n_gpus):
            self.links[f"gpu{g}.h2d"] = hw.h2d
            self.links[f"gpu{g}.d2h"] = hw.d2h
            s = hw.switch_of(g)
            self.links[f"switch{s}.down"] = hw.uplink
            self.links[f"switch{s}.up"] = hw.uplink
        self._sub = 0  # seq tiebreak of everything but compute ops
        self._ops_on: dict[int, list[int]] = {g: [] for g in range(plan.n_gpus)}
        # per GPU, the names and routes every transfer of it uses: made once, not per task
        gpus = range(hw.n_gpus)
        self._dev = [f"gpu{g}" for g in gpus]
        self._compute_lane = [f"gpu{g}.compute" for g in gpus]
        self._h2d = [(f"gpu{g}.h2d", f"switch{hw.switch_of(g)}.down") for g in gpus]
        self._d2h = [(f"gpu{g}.d2h", f"switch{hw.switch_of(g)}.up") for g in gpus]
        # labels' pairs of ints as text, made once per graph (see pair)
        self._pairs: dict[tuple[int, int], str] = {}
        self._spans: dict[tuple[int, int], str] = {}

    def pair(self, t: tuple[int, int]) -> str:
        """``str(t)`` for a pair of ints (samples, layers) in a label. A graph labels
        thousands of tasks and buffers with the same few pairs, and its labels were about
        an eighth of the instructions of building it, so each pair is formatted once per
        graph."""
        text = self._pairs.get(t)
        if text is None:
            text = self._pairs[t] = f"({t[0]}, {t[1]})"
        return text

    def span(self, t: tuple[int, int]) -> str:
        """A range ``(a, b)`` as ``"a..b-1"`` in a label, formatted once per graph (as
        :meth:`pair`)."""
        text = self._spans.get(t)
        if text is None:
            text = self._spans[t] = f"{t[0]}..{t[1] - 1}"
        return text

    def buffer(
        self, device: str, nbytes: float, what: str, samples: tuple[int, int] = (0, 0)
    ) -> int:
        n = len(self.buffers)
        self.buffers.append(Buffer(n, device, float(nbytes), what, 0, samples))
        return n

    def release(self, task: Task, buffer: int) -> None:
        task.releases.append(buffer)
        self.buffers[buffer].refs += 1

    def release_all(self, task: Task, buffers: list[int]) -> None:
        """:meth:`release` of each of ``buffers``, in order."""
        task.releases += buffers
        all_buffers = self.buffers
        for b in buffers:
            all_buffers[b].refs += 1

    def _add(self, task: Task) -> Task:
        self.tasks.append(task)
        return task

    def _next_seq(self, deps: list[int], for_op: int | None) -> tuple[int, int, int]:
        """Priority of a transfer or update: an input of compute op ``for_op`` comes
        just before it; anything else just after the newest op it depends on."""
        self._sub += SEQ_ROOM
        if for_op is not None:
            return (for_op, 0, self._sub)
        tasks = self.tasks
        if len(deps) == 1:  # most often: the task it comes out of
            return (tasks[deps[0]].seq[0], 2, self._sub)
        return (max([tasks[d].seq[0] for d in deps], default=0), 2, self._sub)

    def transfer(
        self,
        kind: str,
        lane: str,
        device: str,
        route: tuple[str, ...],
        nbytes: float,
        deps: list[int],
        what: str,
        *,
        alloc_on: str | None = None,
        max_rate: float = math.inf,
        for_op: int | None = None,
        seq: tuple[int, int, int] | None = None,
        data: Payload = None,
        src: list[int] | None = None,
        pack: int = -1,
        layers: tuple[int, int] = (0, 0),
        microbatch: int = -1,
        samples: tuple[int, int] = (0, 0),
        costs: tuple[float, ...] = (),
    ) -> Task:
        """A transfer of ``data``; it reads buffers ``src`` (and releases them) and,
        with ``alloc_on``, writes a new buffer there (``io["dst"]``). ``seq``: its
        priority, where it is not :meth:`_next_seq`'s. The other keywords are the
        :class:`Task`'s fields."""
        deps = sorted(set(deps)) if len(deps) > 1 else list(deps)
        tasks = self.tasks
        # every field given in order: a graph has thousands of tasks
        t = Task(
            len(tasks),
            kind,
            lane,
            device,
            self._next_seq(deps, for_op) if seq is None else seq,
            deps,
            0.0,
            float(nbytes),
            route,
            max_rate,
            self.model,
            pack,
            layers,
            microbatch,
            samples,
            what,
            data,
            {},
            [],
            [],
            costs,
        )
        tasks.append(t)
        if src:
            t.io["src"] = list(src)
            self.release_all(t, src)
        if alloc_on is not None:
            samples = data.samples if isinstance(data, (Batch, Activation)) else (0, 0)
            n = len(self.buffers)
            self.buffers.append(Buffer(n, alloc_on, float(nbytes), what, 0, samples))
            t.io["dst"] = n
            t.allocs.append(n)
        return t

    # ---- routes ----------------------------------------------------------------
    def h2d_route(self, g: int) -> tuple[str, ...]:
        return self._h2d[g]

    def d2h_route(self, g: int) -> tuple[str, ...]:
        return self._d2h[g]

    def p2p_route(self, src: int, dst: int) -> tuple[tuple[str, ...], float]:
        """GPU->GPU: direct on one switch with peer access; else staged through host memory."""
        if self.hw.p2p is not None and self.hw.switch_of(src) == self.hw.switch_of(dst):
            return (f"gpu{src}.d2h", f"gpu{dst}.h2d"), self.hw.p2p
        return self.d2h_route(src) + self.h2d_route(dst), math.inf

    def _release_dep(self, gpu: int, back: int) -> list[int]:
        """The op ``back`` ops before the next one on ``gpu`` (prefetch window)."""
        ops = self._ops_on[gpu]
        return [ops[-back]] if len(ops) >= back else []
