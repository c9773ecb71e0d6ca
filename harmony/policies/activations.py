"""Activations, their gradients and stashes between the ops of a graph: where
each value is (a GPU, or host memory) after the task that made it, and the
transfers that bring it to the op that needs it (nothing on the same GPU, a
P2P copy from another, a copy in from host memory), prefetched while the op
two before it on that GPU computes; and the minibatch's inputs and labels,
copied in from host memory the same way."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..graph import ACT_OUT, DATA_IN, P2P, STASH_IN, STASH_OUT, Activation, Batch, Task
from ..plan import Plan
from .base import HOST, GraphBase, Op


@dataclass(slots=True)
class Value:
    """An activation (or activation gradient) for a sample range at a pack boundary."""

    samples: tuple[int, int]
    device: str  # "gpuN" or HOST
    task: int | None  # the task after which it is there (None: there from the start)
    buffer: int | None  # its buffer while on a GPU


class ActivationFlow(GraphBase):
    """:class:`GraphBase` with the values passed between ops, by key: ``("act",
    layer)`` the input of a layer, ``("grad", layer)`` its gradient, ``("stash",
    layer)`` the input kept in host memory for recompute."""

    def __init__(self, spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0):
        super().__init__(spec, hw, plan, model)
        # key -> its values' first samples, its values (both sorted), its values by samples
        self._values: dict[tuple, tuple[list[int], list[Value], dict[tuple, Value]]] = {}
        self._stash_layers = set(plan.stash_layers())

    def _produce(self, key: tuple, op: Op, task: Task, buf: int) -> None:
        dev = self._dev[op.gpu]
        value = Value(op.samples, dev, task.id, buf)
        if op.offload_output:
            out = self.transfer(
                ACT_OUT,
                f"{dev}.d2h",
                dev,
                self.d2h_route(op.gpu),
                self.buffers[buf].nbytes,
                [task.id],
                f"offload {key} {self.pair(op.samples)}",
                data=Activation(*key, op.samples),
                src=[buf],
                microbatch=op.microbatch,
                samples=op.samples,
            )
            value = Value(op.samples, HOST, out.id, None)
        self._add_value(key, value)

    def _stash(self, op: Op, task: Task, input_buffers: list[int]) -> None:
        """Save the inputs of backward packs that start inside this forward op."""
        dev = self._dev[op.gpu]
        n = op.samples[1] - op.samples[0]
        for layer in range(op.layers[0], op.layers[1]):
            if layer not in self._stash_layers:
                continue
            if layer == 0:  # the minibatch input is in host memory already
                self._add_value(("stash", 0), Value(op.samples, HOST, None, None))
                continue
            nbytes = self.spec.input_bytes(layer, n)
            if layer == op.layers[0] and len(input_buffers) == 1:
                buf = input_buffers[
                    0
                ]  # the op's own input: its buffer lives until the copy is done
            else:
                what = f"stash of layer {layer} input {self.pair(op.samples)}"
                buf = self.buffer(dev, nbytes, what, op.samples)
                task.allocs.append(buf)
                task.io.setdefault("stash", {})[layer] = buf
            out = self.transfer(
                STASH_OUT,
                f"{dev}.d2h",
                dev,
                self.d2h_route(op.gpu),
                nbytes,
                [task.id],
                f"stash layer {layer} {self.pair(op.samples)}",
                data=Activation("stash", layer, op.samples),
                src=[buf],
                microbatch=op.microbatch,
                samples=op.samples,
                layers=(layer, layer + 1),
            )
            self._add_value(("stash", layer), Value(op.samples, HOST, out.id, None))

    def _add_value(self, key: tuple, value: Value) -> None:
        entry = self._values.get(key)
        if entry is None:
            entry = self._values[key] = ([], [], {})
        starts, values, by_samples = entry
        i = bisect.bisect(starts, value.samples[0])
        starts.insert(i, value.samples[0])
        values.insert(i, value)
        by_samples[value.samples] = value

    def _overlapping(self, key: tuple, samples: tuple[int, int]) -> list[Value]:
        """Values of ``key`` whose samples overlap ``samples`` (they never overlap each other)."""
        a, b = samples
        starts, values, _ = self._values.get(key, ([], [], None))
        i = bisect.bisect_right(starts, a) - 1
        if i < 0:
            i = 0
        out = []
        for v in values[i : bisect.bisect_left(starts, b, i)]:  # those that start before b
            if v.samples[1] > a:
                out.append(v)
        return out

    def _batch_in(self, op: Op, k: int, what: str, nbytes: float) -> Task:
        """The copy of the minibatch's ``what`` ("inputs" or "labels") for the op's
        samples from host memory to its GPU."""
        dev = self._dev[op.gpu]
        return self.transfer(
            DATA_IN,
            f"{dev}.h2d",
            dev,
            self.h2d_route(op.gpu),
            nbytes,
            self._release_dep(op.gpu, 2),
            f"{what} {self.pair(op.samples)}",
            alloc_on=dev,
            for_op=k,
            data=Batch(what, op.samples),
            microbatch=op.microbatch,
            samples=op.samples,
        )

    def _bring(
        self, key: tuple, op: Op, k: int, kind_via_host: str, nbytes: float
    ) -> tuple[list[int], list[int]]:
        """Make the values of ``key`` for the op's samples available on its GPU.

        Returns the tasks the op waits on and the buffers it releases."""
        g = op.gpu
        dev = self._dev[g]
        a, b = samples = op.samples
        entry = self._values.get(key)
        made = entry[2].get(samples) if entry is not None else None
        if made is not None and made.device == dev:  # most often: made here, for these samples
            return ([] if made.task is None else [made.task]), [made.buffer]
        values = self._overlapping(key, samples)
        covered = 0
        devices = set()
        deps = []
        for v in values:
            va, vb = v.samples
            covered += (vb if vb < b else b) - (va if va > a else a)
            devices.add(v.device)
            if v.task is not None:
                deps.append(v.task)
        if covered != b - a:
            raise AssertionError(f"{key} for samples {samples} not produced before {op}")
        if not values or devices == {dev}:
            return deps, [v.buffer for v in values]
        if devices == {HOST}:
            kind = STASH_IN if key[0] == "stash" else kind_via_host
            t = self.transfer(
                kind,
                dev + ".h2d",
                dev,
                self._h2d[g],
                nbytes,
                deps + self._release_dep(op.gpu, 2),
                f"{key[0]} layer {key[1]} {self.pair(op.samples)}",
                alloc_on=dev,
                for_op=k,
                data=Activation(*key, op.samples),
                microbatch=op.microbatch,
                samples=op.samples,
            )
            return [t.id], list(t.allocs)
        if len(devices) != 1:
            raise AssertionError(f"{key} for {samples} spread over {devices}")
        src_gpu = int(next(iter(devices))[3:])
        route, rate = self.p2p_route(src_gpu, op.gpu)
        t = self.transfer(
            P2P,
            f"{dev}.p2p",
            dev,
            route,
            nbytes,
            deps + self._release_dep(op.gpu, 2),
            f"{key[0]} layer {key[1]} {self.pair(op.samples)} from gpu{src_gpu}",
            alloc_on=dev,
            max_rate=rate,
            for_op=k,
            data=Activation(*key, op.samples),
            src=[v.buffer for v in values],
            microbatch=op.microbatch,
            samples=op.samples,
        )
        return [t.id], list(t.allocs)
