"""Turn a model into a chain of layers that the engine can run pack by pack.

A *chain* is a list of modules. Layer 0 is called with the minibatch inputs
unpacked (``layer0(*inputs)``); every next layer is called with the previous
output, unpacked if it is a tuple. The last layer's output goes to the loss
function, which is not part of the chain. Every layer owns its parameters;
a parameter that two layers share (tied weights) is reported in
:attr:`Chain.tied`.

:func:`decompose` accepts

* an ``nn.Sequential``: its children in order; a child that is itself an
  ``nn.Sequential`` is replaced by its children (one level);
* a list or tuple of modules, or an ``nn.ModuleList``: the chain as given
  (the zoo's lists, ``harmony.zoo.build(name)[:-1]``, without the loss);
* a Hugging Face transformers model (transformers 5; see
  :mod:`harmony.engine.decompose_hf`): embeddings (layer 0, called with
  ``input_ids[, attention_mask]``, or ``pixel_values``), one layer per block,
  then the final norm with the head, by its family's recipe (GPT-2, OPT, Bloom,
  Falcon, BERT, RoBERTa, ELECTRA, DistilBERT, ViT, DeiT) or by its layout (any
  decoder-only model laid out as Llama: Llama, Mistral, Mixtral, Qwen2, Qwen3,
  Phi, Gemma, Gemma 2, StableLM, GPT-NeoX, GPT-J, ...). An attention mask travels
  along the chain with the hidden states; a tied LM head is reported in ``tied``.
  The chain is checked against the model's own forward on a small example (or
  ``example_inputs``) before it is returned; a model it cannot split is an error
  that points to the calling convention (the README, "Your own blocks");
* any other module: a :mod:`torch.fx` split of its ``forward``. The top-level
  children are the units (the children of a top-level ``nn.Sequential``,
  ``nn.ModuleList`` or ``nn.ModuleDict`` are units themselves, so a wrapper
  around a Sequential gives the Sequential's modules). The graph is cut
  between consecutive units where exactly one value is live; units that a skip
  connection spans end up in one layer. A segment that is exactly one unit
  called on the segment's input is returned as that module itself, otherwise
  as a ``torch.fx.GraphModule`` that references the model's own submodules
  and parameters.

An in-place module (``nn.ReLU(inplace=True)`` and the like) never starts a
layer: it joins the layer before it, since the engine stashes each layer's input
and differentiates with respect to it. A layer that draws random numbers
without an ``nn.Dropout`` module (functional dropout inside a Hugging Face
block) has ``draws_random = True``, so that the engine seeds and runs it under
its generator lock on several GPUs.

The layers reference the model's parameters (the same ``Parameter`` objects),
never copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx, nn

from ..errors import HarmonyError
from .decompose_checks import (
    check_reference,
    evaluating,
    refuse_raw_blocks,
    warn_if_unsplit,
)
from .decompose_shared import HOW_TO

__all__ = ["Chain", "decompose"]


@dataclass(frozen=True)
class Chain:
    """The layers of a model in order, a name per layer, and the tied parameters.

    ``tied`` holds ``(i, j, name)`` with ``i < j`` for every parameter that
    layers ``i`` and ``j`` share; ``name`` is the parameter's name in the model
    (its first one, as ``model.named_parameters()`` gives it)."""

    layers: list[nn.Module]
    names: list[str]
    tied: list[tuple[int, int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def __getitem__(self, index):
        return self.layers[index]

    def __call__(self, *inputs):
        """Run the whole chain on ``inputs`` with the calling convention and
        return the last layer's output (what the loss function receives)."""
        x: Any = inputs
        for i, layer in enumerate(self.layers):
            x = layer(*x)
            if i < len(self.layers) - 1 and not isinstance(x, tuple):
                x = (x,)
        return x


def decompose(model, *, example_inputs=None, reference=None) -> Chain:
    """Split ``model`` into a :class:`Chain` (see the module documentation).

    ``example_inputs`` (a tensor or a tuple of tensors, what ``model`` is called
    with) is optional. When given, the model runs once on it, in eval mode under
    ``no_grad`` (meta tensors on a meta model cost nothing), so that the split
    knows which values are tuples: an ``nn.Sequential`` child that receives a
    tuple gets wrapped to take it whole, and a torch.fx layer gets one argument
    per element. Without it, values passed between layers are taken to be
    single tensors (the torch.fx layers then take ``*args`` and repack tuples
    of two or more elements).

    ``reference`` (with ``example_inputs``, what the chain takes) is the model a
    hand-written chain stands for: both run on the example, and a chain that
    computes something else is an error naming the first layer whose output
    differs from that of the model's module it calls last."""
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if isinstance(model, (list, tuple)):
        refuse_raw_blocks(list(model), "the list")
        layers, names = _from_list(
            list(model), [f"{i}:{type(m).__name__}" for i, m in enumerate(model)], what="the list"
        )
        canonical = {
            id(p): f"{i}.{n}"
            for i, m in reversed(list(enumerate(layers)))
            for n, p in reversed(list(m.named_parameters()))
        }
        chain = _finish(layers, names, canonical, None)
    else:
        chain = _from_module(model, example_inputs)
    if reference is not None:
        check_reference(chain.layers, chain.names, reference, example_inputs)
    warn_if_unsplit(chain.layers, chain.names, model if isinstance(model, nn.Module) else None)
    return chain


def _from_module(model, example_inputs) -> Chain:
    if not isinstance(model, nn.Module):
        raise HarmonyError(
            f"cannot split a {type(model).__name__} into layers: {HOW_TO}, "
            "or an nn.Module whose forward torch.fx can trace"
        )
    if isinstance(model, nn.ModuleList):
        refuse_raw_blocks(list(model), "the nn.ModuleList")
        layers, names = _from_list(
            list(model), [n for n, _ in model.named_children()], what="the nn.ModuleList"
        )
    elif isinstance(model, nn.Sequential):
        layers, names = _from_sequential(model, example_inputs)
    elif type(model).__module__.startswith("transformers."):
        from .decompose_hf import split  # imports transformers: only for its models

        layers, names = split(model, example_inputs)
    else:
        layers, names = _from_fx(model, example_inputs)
    canonical = {}
    for n, p in model.named_parameters():
        canonical.setdefault(id(p), n)
    return _finish(layers, names, canonical, model)


# ---- lists and Sequentials ----------------------------------------------------
def _from_list(items: list, names: list[str], what: str) -> tuple[list[nn.Module], list[str]]:
    if not items:
        raise HarmonyError(f"{what} is empty: a chain needs at least one layer")
    for i, m in enumerate(items):
        if not isinstance(m, nn.Module):
            raise HarmonyError(
                f"element {i} of {what} is a {type(m).__name__}, not an nn.Module: "
                "every layer of a chain must be a module that owns its parameters"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise HarmonyError(
                f"element {i} of {what} is an nn.{type(m).__name__}, which cannot be called: "
                "put its modules into the list one by one"
            )
    last = items[-1]
    if isinstance(last, nn.modules.loss._Loss) or type(last).__name__ == "CrossEntropyLoss":
        raise HarmonyError(
            f"the last element of {what} is a loss ({type(last).__name__}); the chain excludes "
            "the loss: pass the layers without it (e.g. zoo.build(name)[:-1]) and give the loss "
            "function to the engine separately"
        )
    return list(items), list(names)


def _from_sequential(model: nn.Sequential, example_inputs) -> tuple[list[nn.Module], list[str]]:
    layers, names = [], []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):  # flattened one level; an empty one is the identity
            for inner, grandchild in child.named_children():
                layers.append(grandchild)
                names.append(f"{name}.{inner}")
        else:
            layers.append(child)
            names.append(name)
    if not layers:
        raise HarmonyError("the nn.Sequential is empty: a chain needs at least one layer")
    layers, names = _from_list(*_join_in_place(layers, names), what="the nn.Sequential")
    if example_inputs is not None:
        layers = _take_tuples_whole(layers, names, example_inputs)
    return layers, names


def _in_place(module: nn.Module) -> bool:
    """Whether ``module`` overwrites its input (``nn.ReLU(inplace=True)`` and the like).
    Such a module never starts a layer: the engine stashes a layer's input and
    differentiates with respect to it, so the layer must not overwrite it."""
    return getattr(module, "inplace", False) is True


def _join_in_place(layers: list[nn.Module], names: list[str]) -> tuple[list[nn.Module], list[str]]:
    """Each in-place module joins the layer before it, as an ``nn.Sequential`` of both."""
    groups: list[tuple[list[nn.Module], list[str]]] = []
    for layer, name in zip(layers, names):
        if groups and _in_place(layer):
            groups[-1][0].append(layer)
            groups[-1][1].append(name)
        else:
            groups.append(([layer], [name]))
    return (
        [g[0] if len(g) == 1 else nn.Sequential(*g) for g, _ in groups],
        ["+".join(n) for _, n in groups],
    )


class TupleArgument(nn.Module):
    """Calls ``module`` with its arguments packed into one tuple: the chain unpacks
    a tuple between layers, while ``nn.Sequential`` passes it whole."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(args)


def _take_tuples_whole(layers, names, example_inputs) -> list[nn.Module]:
    """Run the Sequential's semantics on the example and wrap each layer that receives a tuple."""
    if len(example_inputs) != 1:
        raise HarmonyError(
            f"an nn.Sequential takes one input, but example_inputs has {len(example_inputs)}; "
            "pass the single input tensor"
        )
    out, x = list(layers), example_inputs[0]
    with evaluating(layers), torch.no_grad():
        for i, layer in enumerate(layers):
            if i > 0 and isinstance(x, tuple):
                out[i] = TupleArgument(layer)
            try:
                x = layer(x)
            except Exception as e:  # noqa: BLE001 - reported with the layer's name
                raise HarmonyError(
                    f"running example_inputs through layer {names[i]} ({type(layer).__name__}) "
                    f"failed: {type(e).__name__}: {e}; pass inputs the model accepts"
                ) from e
    return out


# ---- torch.fx -----------------------------------------------------------------
def _units(model: nn.Module) -> set[str]:
    """Qualified names of the modules that become (parts of) layers."""
    units = set()
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            units.update(f"{name}.{inner}" for inner, _ in child.named_children())
        else:
            units.add(name)
    return units


class _UnitTracer(fx.Tracer):
    """Traces the model's own forward and the top-level containers, but not into units."""

    def __init__(self, units: set[str]):
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units or super().is_leaf_module(
            m, module_qualified_name
        )


def _pack(*values):
    """Rebuilds a tuple that the chain passed unpacked."""
    return values


def _restore(args: tuple):
    """The value the previous layer returned, from the arguments the chain passed."""
    return args[0] if len(args) == 1 else args


class _Kinds(fx.Interpreter):
    """Runs the traced graph and notes, per node, the tuple length of its value (-1: not a
    tuple)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.kinds: dict[fx.Node, int] = {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        self.kinds[n] = len(value) if isinstance(value, tuple) else -1
        return value


def _from_fx(model: nn.Module, example_inputs) -> tuple[list[nn.Module], list[str]]:
    kind = type(model).__name__
    units = _units(model)
    tracer = _UnitTracer(units)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure gets the same advice
        raise HarmonyError(
            f"cannot split {kind} into layers: torch.fx could not trace its forward "
            f"({type(e).__name__}: {e}). Data-dependent control flow or Python code on tensor "
            f"values in {kind}.forward cannot be traced; {HOW_TO}, or move that code into a "
            "child module (children are not traced into)"
        ) from None
    gm = fx.GraphModule(tracer.root, graph, kind)
    kinds: dict[fx.Node, int] | None = None
    if example_inputs is not None:
        interpreter = _Kinds(gm)
        try:
            with evaluating([model]), torch.no_grad():
                interpreter.run(*example_inputs)
        except Exception as e:  # noqa: BLE001
            raise HarmonyError(
                f"running example_inputs through {kind} failed ({type(e).__name__}: {e}); "
                "pass inputs the model accepts, on its device"
            ) from e
        kinds = interpreter.kinds

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(nodes)}
    position[output] = len(nodes)
    anchors = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in units]
    single = _single_live_value(placeholders, nodes, position)

    cuts = []
    for a, b in zip(anchors, anchors[1:]):
        if _in_place(gm.get_submodule(nodes[b].target)):
            continue  # it stays with the unit before it (see _in_place)
        valid = [p for p in range(a + 1, b + 1) if single[p] is not None]
        if valid:
            cuts.append(valid[-1])  # the ops after a unit stay with it
    bounds = [0, *cuts, len(nodes)]
    layers, names = [], []
    for k, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        source = placeholders if k == 0 else single[start]
        result = output if stop == len(nodes) else single[stop]
        segment = nodes[start:stop]
        names.append(
            "+".join(n.target for n in segment if n.op == "call_module" and n.target in units)
            or kind
        )
        layers.append(
            _bare_unit(gm, segment, source, result, kinds, units)
            or _segment_module(gm, segment, source, result, kinds, f"{kind}_{k}", model.training)
        )
    return layers, names


def _single_live_value(placeholders, nodes, position) -> list[fx.Node | None]:
    """For each cut position p (before ``nodes[p]``), the one value defined before it and
    used at or after it, or None when there are several or none. Attributes (get_attr)
    do not count: every layer that uses one reads it itself."""
    n = len(nodes)
    adds: list[list[fx.Node]] = [[] for _ in range(n + 2)]
    removes: list[list[fx.Node]] = [[] for _ in range(n + 2)]
    for v in [*placeholders, *nodes]:
        if v.op == "get_attr" or not v.users:
            continue
        defined = -1 if v.op == "placeholder" else position[v]
        last_use = max(position[u] for u in v.users)
        if last_use > defined:
            adds[defined + 1].append(v)
            removes[last_use + 1].append(v)
    live: dict[fx.Node, None] = {}
    single: list[fx.Node | None] = []
    for p in range(n + 1):
        for v in removes[p]:
            live.pop(v, None)
        for v in adds[p]:
            live[v] = None
        single.append(next(iter(live)) if len(live) == 1 else None)
    return single


def _bare_unit(gm, segment, source, result, kinds, units) -> nn.Module | None:
    """The unit itself when the segment is nothing but that unit called on the segment's input."""
    work = [n for n in segment if n.op != "get_attr"]
    if (
        len(work) != 1
        or work[0].op != "call_module"
        or work[0].target not in units
        or work[0].kwargs
    ):
        return None
    call = work[0]
    if isinstance(source, list):  # the first layer: the model's inputs, all passed positionally
        if any(p.target.startswith("*") or p.args for p in source) or call.args != tuple(source):
            return None
    elif call.args != (source,) or (kinds is not None and kinds.get(source, -1) >= 0):
        return None  # a tuple the unit takes whole, while the chain unpacks it
    if result.op == "output":
        if result.args[0] is not call:
            return None
    elif result is not call:
        return None
    return gm.get_submodule(call.target)


def _segment_module(gm, segment, source, result, kinds, class_name, training) -> fx.GraphModule:
    """A GraphModule computing ``segment``: from the model's inputs (first layer) or from
    ``source`` passed with the calling convention, to ``result`` (the model's output for the
    last)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    if isinstance(source, list):
        for p in source:
            env[p] = g.node_copy(p)
    else:
        length = None if kinds is None else kinds.get(source, -1)
        if length is None:
            args = g.placeholder("*args")
            env[source] = g.call_function(_restore, (args,))
        elif length < 0:
            env[source] = g.placeholder(source.name)
        else:
            parts = [g.placeholder(f"{source.name}_{i}") for i in range(length)]
            env[source] = g.call_function(_pack, tuple(parts))

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # an attribute first read in another layer
            assert node.op == "get_attr", node
            env[node] = g.node_copy(node)
        return env[node]

    for node in segment:
        # an attribute is read where used, so that no layer holds weights it does not use
        if node.op != "get_attr":
            env[node] = g.node_copy(node, lookup)
    if result.op == "output":
        g.output(fx.node.map_arg(result.args[0], lookup))
    else:
        g.output(lookup(result))
    g.lint()
    module = fx.GraphModule(gm, g, class_name)
    module.training = training  # only the flag: the shared submodules keep theirs
    return module


# ---- common -------------------------------------------------------------------
def _finish(layers: list[nn.Module], names: list[str], canonical: dict[int, str], model) -> Chain:
    """Report the parameters layers share, and check every parameter of the model has a layer."""
    owner: dict[int, int] = {}
    tied: list[tuple[int, int, str]] = []
    for i, layer in enumerate(layers):
        for local, p in layer.named_parameters():
            if id(p) in owner:
                tied.append((owner[id(p)], i, canonical.get(id(p), f"{names[i]}.{local}")))
            else:
                owner[id(p)] = i
    if model is not None:
        orphans = [n for n, p in model.named_parameters() if id(p) not in owner]
        if orphans:
            shown = ", ".join(orphans[:5]) + (
                f" and {len(orphans) - 5} more" if len(orphans) > 5 else ""
            )
            raise HarmonyError(
                f"parameters of {type(model).__name__} belong to no layer: {shown}. Its forward "
                f"does not use them; remove them from the model, or {HOW_TO} that holds them"
            )
    return Chain(layers=layers, names=names, tied=tied)
