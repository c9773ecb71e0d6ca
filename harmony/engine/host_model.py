"""The host copy of the model, as the engine's steps read it.

The layers stay the user's modules: they hold the master weights. Their
parameters and buffers are looked up once here, because while a compute
thread runs a layer on device tensors (:meth:`HostModel.run`) the layer's
attributes point at them, and other threads must never read them from the
module. With them: the parameters several layers share (tied
weights), the layers that draw random numbers, a weightless copy of each
layer for every GPU but the first, the flat host layout of the weights and
their gradients, and the pool of host buffers a step sends values to
(:mod:`.buffers`).
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from ..errors import HarmonyError
from ..plan import Plan, layer_shard
from ..policies import STATE_OPTIONS, update_shards
from .buffers import BufferPool, HostLayout
from .weight_swap import WeightSlots


class HostModel:
    """``layers`` (in host memory) and ``module``, the one whose state_dict holds
    every host weight and buffer; ``pin``: page-lock the flat host buffers (for
    a GPU); ``flatten``: lay them out now (False: later, see
    :meth:`~.buffers.HostLayout.flatten`)."""

    def __init__(
        self, layers: list[nn.Module], module: nn.Module, pin: bool = False, flatten: bool = True
    ):
        check_on_host(layers)
        self.layers, self.module = layers, module
        self.layout = HostLayout(layers, pin=pin, flatten=flatten)
        self.pool = BufferPool("cpu", pin=pin)
        self.params = [dict(layer.named_parameters()) for layer in layers]
        self.buffers = [dict(layer.named_buffers()) for layer in layers]
        # parameters several layers share: the layers and the first name in each
        tied: dict[int, list[tuple[int, str]]] = {}
        for i, params in enumerate(self.params):
            for name, p in params.items():
                tied.setdefault(id(p), []).append((i, name))
        self.tied = {k: v for k, v in tied.items() if len(v) > 1}
        self._split_ties: dict[tuple[int, int], list] = {}
        # Layers that draw random numbers: with several compute threads, seeding the
        # generator and running such a layer must not interleave. A layer whose dropout
        # is functional (no module to find) says so with draws_random (see decompose).
        self.random_layers = {
            i
            for i, layer in enumerate(layers)
            if getattr(layer, "draws_random", False)
            or any(
                isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in layer.modules()
            )
        }
        self._replicas: dict[tuple[int, int], nn.Module] = {}
        self._slots: dict[tuple[int, int], WeightSlots] = {}
        self._replica_lock = threading.Lock()

    def split_ties(self, start: int, stop: int) -> list[tuple[int, str, nn.Parameter]]:
        """The parameters that layers [start, stop) share with layers outside it,
        each as (layer, name) of its first use inside, and the parameter."""
        found = self._split_ties.get((start, stop))
        if found is None:
            found = []
            for uses in self.tied.values():
                inside = [(i, name) for i, name in uses if start <= i < stop]
                if inside and len(inside) < len(uses):
                    i, name = inside[0]
                    found.append((i, name, self.params[i][name]))
            self._split_ties[(start, stop)] = found
        return found

    def run(self, gpu: int, index: int, weights: dict[str, torch.Tensor], args: tuple):
        """Layer ``index`` on GPU ``gpu``'s ``weights`` (name -> tensor): its
        :meth:`replica` with them swapped in for the call."""
        slots = self._slots.get((gpu, index))
        if slots is None:
            module = self.replica(gpu, index)
            with self._replica_lock:
                slots = self._slots.setdefault((gpu, index), WeightSlots(module))
        return slots(weights, args)

    def replica(self, gpu: int, index: int) -> nn.Module:
        """Layer ``index`` to run on GPU ``gpu``: the host module on the first GPU, a
        weightless copy on the others (a run swaps device weights into the module,
        so two GPUs must not run the same module object)."""
        if gpu == 0:
            return self.layers[index]
        with self._replica_lock:
            module = self._replicas.get((gpu, index))
            if module is None:
                module = weightless_copy(self.layers[index])
                self._replicas[(gpu, index)] = module
            return module

    def make_replicas(self, gpus) -> None:
        """Every layer's copy for ``gpus``, made while no step is swapping weights in."""
        for gpu in gpus:
            for index in range(len(self.layers)):
                self.replica(gpu, index)

    def update_params(self, plan: Plan, shards: int) -> dict[tuple[int, int], list[nn.Parameter]]:
        """The parameters each update steps: (pack, shard) -> parameters.

        Data parallel over k GPUs splits a pack into k ``shards`` of whole layers
        (see :func:`~harmony.plan.layer_shard`). A parameter shared by layers
        in several packs (tied weights) belongs to the pack that runs backward
        last, the one with the lowest layers: the packs before it only add their
        gradient to the host copy, so it is stepped once, with the sum."""
        units = [
            ((q, r), layer_shard(pack, r, shards))
            for q, pack in enumerate(plan.bwd_packs)
            for r in range(shards)
        ]
        owner: dict[int, tuple[int, int]] = {}
        for key, layers in units:
            for i in layers:
                for p in self.layers[i].parameters():
                    if id(p) in owner and owner[id(p)][0] == key[0] and owner[id(p)] != key:
                        raise HarmonyError(
                            "tied weights inside one backward pack are not supported with data "
                            "parallel updates; put the tied layers in different packs or use "
                            "harmony-pp"
                        )
                    owner.setdefault(id(p), key)
        out: dict[tuple[int, int], list[nn.Parameter]] = {}
        for key, layers in units:
            seen: set[int] = set()
            out[key] = [
                p
                for i in layers
                for p in self.layers[i].parameters()
                if owner[id(p)] == key and not (id(p) in seen or seen.add(id(p)))
            ]
        return out


def params_per_update(host: HostModel, plan: Plan) -> dict[tuple[int, int], list[nn.Parameter]]:
    """The parameters each update of ``plan`` steps: (pack, shard) -> parameters (see
    :meth:`HostModel.update_params`). A plan that keeps gradient sums or the optimizer
    on the GPUs has one optimizer per pack, which every GPU that runs the pack steps
    whole (update_shards refuses those options, from before the engine ran them)."""
    on_gpus = any(plan.option(k) for k in STATE_OPTIONS)
    return host.update_params(plan, 1 if on_gpus else update_shards(plan))


def check_on_host(layers: list[nn.Module]) -> None:
    """The model is the host copy of the weights: its tensors must be in host
    memory (those on the meta device are the engine's to make or refuse first:
    :mod:`.lazy_weights`)."""
    for i, layer in enumerate(layers):
        for name, t in (*layer.named_parameters(), *layer.named_buffers()):
            if t.device.type != "cpu":
                raise HarmonyError(
                    f"layer {i} ({type(layer).__name__}) has {name} on {t.device}: the engine "
                    "keeps the model in host memory and moves packs to the devices itself; pass "
                    "the model on the CPU (model.to('cpu')) and the GPUs as device="
                )


def weightless_copy(layer: nn.Module) -> nn.Module:
    """``layer`` with every parameter and buffer replaced by a tensor on the meta
    device, shared where the layer shares it: a parameter that two submodules
    hold (tied weights inside one layer) stays one parameter, so
    a run ties both names to the one device tensor it is given.
    Nothing is copied (``deepcopy`` then ``.to("meta")`` would copy every weight
    and untie shared ones)."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)
