"""Weights made where they live: a model built with its parameters on the meta
device, whose weights the engine makes layer by layer only as it places them.

A model larger than host memory cannot be built in host memory first. Built
under :func:`empty_weights` (its parameters on the ``meta`` device, no memory;
its buffers, such as a causal mask, made as usual) and given to the
:class:`~harmony.engine.Engine`, its weights are made at the first step, once
the placement is known: the master weights the disk tier keeps are made one
update at a time, written to the tier and given back, so they are never in
host memory together; the rest are made in the host layout's flat buffers.

Values: each layer's parameters are made by every submodule's
``reset_parameters()`` then ``init(layer)`` (e.g. GPT-2's N(0, 0.02)), with
torch's CPU generator seeded from the engine's seed and the layer's index
(:func:`init_seed`). A layer's values are then the same whenever, and in
whatever order, it is made; :func:`materialize` makes the same values in host
memory (a run that fits, to compare with). A parameter several layers share
is made with the first of them and hidden from the others' initialisation. A
parameter that neither leaves set is an error (parameters are NaN until set).
A placeholder an earlier engine left (its master weight on that engine's
disk tier) is not made anew: a checkpoint or the tier gives its value
(``Engine.load``), else making it is an error.

Until made, a parameter is a *placeholder* (:func:`~.disk_staging.placeholder`:
its shape and dtype, one element broadcast); describing and profiling the
model run on those (sizes and times do not depend on the values).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..errors import HarmonyError
from .disk_staging import has_memory, placeholder
from .reference_loop import layer_seed

#: the mark of a placeholder whose parameter never had values (made from a meta one):
#: unmade, where any other placeholder is a master weight an engine left on its disk tier
_NEVER_MADE = "_harmony_never_made"


def _never_made(p: nn.Parameter) -> bool:
    return getattr(p, _NEVER_MADE, False)


def _mark(params: Iterable[nn.Parameter], never_made: bool) -> None:
    for p in params:
        if never_made:
            setattr(p, _NEVER_MADE, True)
        else:
            p.__dict__.pop(_NEVER_MADE, None)


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Inside this block, every parameter a module registers is put on the
    ``meta`` device (no memory, no values); buffers are made as usual (they hold
    what the constructor computed, e.g. a causal mask). Build a model larger
    than host memory in it and hand it to the engine, which makes the weights
    where they live (see the module docstring). Not thread-safe: it patches
    ``nn.Module.register_parameter`` for the duration."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        lazy = isinstance(param, nn.parameter.UninitializedParameter)
        if param is not None and not lazy and param.device.type != "meta":
            param = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_seed(seed: int, layer: int) -> int:
    """The generator's seed for making layer ``layer``'s weights (a step before
    the first, so no step's dropout draws the same numbers)."""
    return layer_seed(seed, -1, 0, layer)


def materialize(model, init: Callable | None = None, seed: int = 0):
    """Make the weights of ``model`` (built under :func:`empty_weights`) in host
    memory, with the values the engine makes them with for the same ``init`` and
    ``seed``: the in-memory twin of a run whose weights the engine makes.
    Returns ``model``."""
    from .decompose import decompose

    layers = list(decompose(model).layers)
    unmade = UnmadeWeights.of(model, layers, init, seed)
    if unmade is None:
        raise HarmonyError("materialize: the model has no parameters on the meta device")
    unmade.make_all()
    return model


class UnmadeWeights:
    """The parameters of ``layers`` not made yet (see the module docstring):
    :meth:`of` replaces the meta parameters of ``modules`` by placeholders."""

    def __init__(self, layers: list[nn.Module], init: Callable | None, seed: int):
        self.layers, self.init, self.seed = layers, init, seed
        # per layer, the parameters first held by it (the layer that makes them)
        self.first: list[list[nn.Parameter]] = []
        owner: set[int] = set()
        for layer in layers:
            own = [p for p in layer.parameters() if id(p) not in owner]
            owner.update(id(p) for p in own)
            self.first.append(own)
        self.layer_of = {id(p): i for i, ps in enumerate(self.first) for p in ps}
        self.pending: set[int] = set()  # ids of the parameters not made yet

    @classmethod
    def of(
        cls, model, layers: list[nn.Module], init: Callable | None, seed: int
    ) -> "UnmadeWeights | None":
        """The unmade weights of ``model`` cut into ``layers``: its meta parameters
        become placeholders (one new parameter per meta one, in every module
        that holds it, so tied weights stay tied); None if it has none."""
        if init is not None and not callable(init):
            raise HarmonyError(f"init must be a function of a layer, got {init!r}")
        modules = [m for layer in layers for m in layer.modules()]
        if isinstance(model, nn.Module):
            modules += list(model.modules())
        for m in modules:
            for name, b in m.named_buffers(recurse=False):
                if b is not None and b.is_meta:
                    raise HarmonyError(
                        f"{type(m).__name__}.{name} is a buffer on the meta device: its values "
                        "(what the constructor computed) are lost there. Build the model under "
                        "harmony.empty_weights(), which puts only parameters on the meta device"
                    )
        made: dict[int, nn.Parameter] = {}  # id(meta or placeholder) -> its placeholder
        for m in modules:
            for name, p in m._parameters.items():
                if p is not None and p.is_meta:
                    if id(p) not in made:
                        new = nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad)
                        new.data = placeholder(p)
                        _mark([new], never_made=True)
                        made[id(p)] = new
                    m._parameters[name] = made[id(p)]
                elif p is not None and not has_memory(p):  # a placeholder already
                    made[id(p)] = p
        if not made:
            if init is not None:
                raise HarmonyError(
                    "init= initializes the weights of a model built on the meta device "
                    "(harmony.empty_weights()); this model's weights are made already"
                )
            return None
        unmade = cls(layers, init, seed)
        unmade.pending = {id(p) for p in made.values()}
        return unmade

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is not made yet."""
        return id(p) in self.pending

    def make(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Make ``params`` (those not made yet) with every parameter first held by
        the same layers (a layer is made whole); returns the parameters made."""
        made = []
        for i in sorted({self.layer_of[id(p)] for p in params if id(p) in self.pending}):
            made += self._make_layer(i)
        return made

    def unmake(self, params: Iterable[nn.Parameter]) -> None:
        """``params`` are unmade again (placeholders: their memory is given back),
        e.g. made for a disk tier that then failed to take them."""
        params = list(params)
        with torch.no_grad():
            for p in params:
                p.data = placeholder(p)
                self.pending.add(id(p))
        _mark(params, never_made=True)

    def make_all(self) -> None:
        for i in range(len(self.layers)):
            if any(id(p) in self.pending for p in self.first[i]):
                self._make_layer(i)

    def adopt(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """``p``'s value is ``value`` (a checkpoint's), not made."""
        with torch.no_grad():
            p.data = value.detach().to("cpu", p.dtype, copy=True).contiguous()
        self.pending.discard(id(p))
        _mark([p], never_made=False)

    def kept_elsewhere(self, params: Iterable[nn.Parameter]) -> None:
        """``params`` have values elsewhere (a resumed run's disk tier): not made here."""
        params = list(params)
        self.pending -= {id(p) for p in params}
        _mark(params, never_made=False)  # an engine's placeholders now, their values on its tier

    def nbytes(self, params: Iterable[nn.Parameter]) -> int:
        """Bytes that making the unmade ones of ``params`` adds."""
        return sum(p.numel() * p.element_size() for p in params if id(p) in self.pending)

    def _make_layer(self, i: int) -> list[nn.Parameter]:
        layer = self.layers[i]
        making = [p for p in self.first[i] if id(p) in self.pending]
        ids = {id(p) for p in making}
        names = {id(p): n for n, p in layer.named_parameters()}
        for p in making:
            if not _never_made(p):  # a placeholder an earlier engine left
                raise HarmonyError(
                    f"layer {i} ({type(layer).__name__}): {names[id(p)]} has no values: its "
                    "master weight lives on another engine's disk tier. Continue that run "
                    "with Engine.load(checkpoint, model, ...), read the weights with that "
                    "engine's model_state_dict(), or build the model anew"
                )
        with torch.no_grad():
            for p in making:
                if not has_memory(p):
                    p.data = torch.empty(p.shape, dtype=p.dtype)  # a placeholder: no memory yet
                if p.is_floating_point():
                    p.fill_(float("nan"))  # what initialisation leaves unset stays NaN
        with _hidden(layer, ids), torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(init_seed(self.seed, i))
            for m in layer.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            if self.init is not None:
                self.init(layer)
        for p in making:
            if p.is_floating_point() and bool(torch.isnan(p).any()):
                raise HarmonyError(
                    f"layer {i} ({type(layer).__name__}): {names[id(p)]} was left unset by its "
                    "modules' reset_parameters() and init=: give an init= that sets it"
                )
        self.pending -= ids
        _mark(making, never_made=False)
        return making


@contextlib.contextmanager
def _hidden(layer: nn.Module, making: set[int]) -> Iterator[None]:
    """Inside, ``layer``'s parameters that are not being made (shared with a layer
    made before, or whose values live elsewhere) are meta tensors: the layer's
    initialisation cannot change them and draws no numbers for them."""
    swapped = []
    for m in layer.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) not in making:
                swapped.append((m, name, p))
                m._parameters[name] = nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                )
    try:
        yield
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p
