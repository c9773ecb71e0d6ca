"""Splitting models into chains: every kind of model gives a chain that computes
exactly what the model computes, with the model's own Parameter objects."""

import pytest
import torch
from torch import fx, nn

from harmony import zoo
from harmony.engine.decompose import Chain, TupleArgument, decompose
from harmony.errors import HarmonyError


# ---- helpers -------------------------------------------------------------------
def run_chain(layers, inputs):
    """The calling convention, written out independently of Chain.__call__."""
    x = inputs
    for layer in layers:
        x = layer(*x)
        x = x if isinstance(x, tuple) else (x,)
    return x[0] if len(x) == 1 else x


def check_params(chain: Chain, params):
    """Same Parameter objects; each in exactly one layer unless reported in ``tied``."""
    tied_pairs = {(i, j) for i, j, _ in chain.tied}
    where: dict[int, list[int]] = {}
    for i, layer in enumerate(chain.layers):
        for p in layer.parameters():
            where.setdefault(id(p), []).append(i)
    model_ids = {id(p) for p in params}
    assert set(where) == model_ids, "the chain's parameters are exactly the model's (identity)"
    for owners in where.values():
        for j in owners[1:]:
            assert (owners[0], j) in tied_pairs


def assert_same(chain, model, *inputs):
    with torch.no_grad():
        expected = model(*inputs)
        got = run_chain(chain.layers, inputs)
        assert torch.equal(chain(*inputs), got)
    assert torch.equal(got, expected)


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- lists and Sequentials -------------------------------------------------------
def test_sequential_with_residual_block_and_nested_sequential():
    model = nn.Sequential(
        nn.Linear(8, 16),
        Residual(16),
        nn.ReLU(),
        nn.Sequential(nn.Linear(16, 4), nn.Sequential(nn.Tanh())),
    )
    chain = decompose(model)
    assert chain.names == ["0", "1", "2", "3.0", "3.1"]  # flattened one level only
    assert chain[1] is model[1] and isinstance(chain[4], nn.Sequential)
    assert len(chain) == 5 and list(chain) == chain.layers and chain.tied == []
    check_params(chain, model.parameters())
    assert_same(chain, model, torch.randn(3, 8))


def test_list_of_blocks_and_module_list():
    blocks = [nn.Linear(6, 6), Residual(6), nn.GELU(), nn.Linear(6, 2)]
    chain = decompose(blocks)
    assert chain.layers == blocks and chain.names[1] == "1:Residual"
    check_params(chain, nn.ModuleList(blocks).parameters())
    assert_same(chain, nn.Sequential(*blocks), torch.randn(5, 6))

    ml = nn.ModuleList(blocks)
    chain = decompose(ml)
    assert chain.names == ["0", "1", "2", "3"] and chain.layers == blocks
    check_params(chain, ml.parameters())


def test_zoo_list_without_loss():
    layers = zoo.build("gpt2-tiny", device="cpu")
    with pytest.raises(HarmonyError, match="excludes the loss"):
        decompose(layers)
    chain = decompose(layers[:-1])
    assert chain.layers == layers[:-1] and chain.tied == []
    check_params(chain, [p for layer in layers for p in layer.parameters()])
    (ids,), target = zoo.example_input("gpt2-tiny", 2)
    for layer in layers:
        layer.eval()
    with torch.no_grad():
        assert torch.equal(layers[-1](chain(ids), target), zoo.forward(layers, (ids,), target))


def test_tied_layers_in_a_list():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    chain = decompose([emb, nn.LayerNorm(4), head])
    assert chain.tied == [(0, 2, "0.weight")]
    check_params(chain, [emb.weight, *chain[1].parameters()])


def test_sequential_child_taking_a_tuple_whole():
    class Split(nn.Module):
        def forward(self, x):
            return x.chunk(2, dim=-1)

    class Join(nn.Module):  # nn.Sequential hands it the tuple as one argument
        def forward(self, parts):
            return parts[0] * parts[1]

    model = nn.Sequential(nn.Linear(4, 8), Split(), Join())
    x = torch.randn(3, 4)
    chain = decompose(model, example_inputs=x)
    assert isinstance(chain[2], TupleArgument) and chain[2].module is model[2]
    check_params(chain, model.parameters())
    assert_same(chain, model, x)


# ---- torch.fx --------------------------------------------------------------------
class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), Residual(8), nn.Linear(8, 3))

    def forward(self, x):
        return self.layers(x)


class ListWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Residual(8) for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    "cls, names",
    [
        (Wrapper, ["layers.0", "layers.1", "layers.2"]),
        (ListWrapper, ["blocks.0", "blocks.1", "blocks.2"]),
    ],
)
def test_wrapper_around_a_chain_gives_its_modules(cls, names):
    model = cls()
    chain = decompose(model)
    assert chain.names == names
    assert all(layer is model.get_submodule(n) for layer, n in zip(chain, names))
    check_params(chain, model.parameters())
    assert_same(chain, model, torch.randn(4, 8))


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        x = self.a(x)
        x = self.b(x) + x
        x = self.c(x)
        return x


class LongSkip(nn.Module):
    """A residual spanning b and c; a parameter of the model's own; a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        x = torch.relu(self.c(self.b(x))) + x
        return self.head(x * self.scale)


@pytest.mark.parametrize("example", [False, True])
def test_fx_split_merges_what_a_skip_spans(example):
    model = Skip()
    x = torch.randn(5, 8)
    chain = decompose(model, example_inputs=(x,) if example else None)
    assert chain.names == ["a", "b", "c"]
    assert chain[0] is model.a and chain[2] is model.c and isinstance(chain[1], fx.GraphModule)
    check_params(chain, model.parameters())
    assert_same(chain, model, x)

    model = LongSkip()
    ids = torch.randint(0, 20, (3, 7))
    chain = decompose(model, example_inputs=ids if example else None)
    assert chain.names == ["emb", "b+c", "head"]
    assert chain.tied == [(0, 2, "emb.weight")]
    assert (
        chain[1].get_parameter("scale") is model.scale and chain[2] is model.head
    )  # ops follow the unit before
    check_params(chain, model.parameters())
    assert_same(chain, model, ids)
    # gradients reach the model's own parameters, the tied one from both layers
    model(ids).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chain(ids).square().mean().backward()
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("example", [False, True])
def test_fx_split_passes_tuples_unpacked(example):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x), x.mean(dim=-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Two(), nn.Bilinear(4, 1, 3)

        def forward(self, x):
            h, m = self.first(x)
            return self.second(h, m)

    model, x = Model(), torch.randn(6, 4)
    chain = decompose(model, example_inputs=x if example else None)
    assert chain.names == ["first", "second"] and chain[0] is model.first
    check_params(chain, model.parameters())
    assert_same(chain, model, x)


def test_data_dependent_control_flow_is_a_clear_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            if x.sum() > 0:
                x = self.b(x)
            return x

    with pytest.raises(HarmonyError, match=r"Branchy.*torch\.fx.*nn\.Sequential or a list"):
        decompose(Branchy())


@pytest.mark.parametrize(
    "bad, message",
    [
        (nn.Sequential(), "empty"),
        ([], "empty"),
        ([nn.Linear(2, 2), "relu"], "element 1 of the list is a str"),
        ([nn.ModuleList([nn.Linear(2, 2)])], "cannot be called"),
        (nn.Sequential(nn.Linear(2, 2), nn.MSELoss()), "excludes the loss"),
        (42, "cannot split a int"),
    ],
)
def test_bad_inputs_are_clear_errors(bad, message):
    with pytest.raises(HarmonyError, match=message):
        decompose(bad)


def test_parameters_outside_every_layer_are_an_error():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(HarmonyError, match=r"belong to no layer: spare\.weight, spare\.bias"):
        decompose(Unused())


# ---- Hugging Face GPT-2 ----------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_gpt2_with_tied_head(attn):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attn
    model = transformers.GPT2LMHeadModel(config).eval()
    chain = decompose(model)
    assert chain.names == [
        "transformer.wte+wpe+drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f+lm_head",
    ]
    assert chain.tied == [(0, 3, "transformer.wte.weight")]
    assert chain[0].wte.weight is chain[3].lm_head.weight is model.transformer.wte.weight
    check_params(chain, model.parameters())
    ids = torch.randint(0, 100, (3, 12))
    with torch.no_grad():
        assert torch.equal(chain(ids), model(ids).logits)

    body = decompose(model.transformer)  # GPT2Model: no head, ends with ln_f
    assert body.names[-1] == "ln_f" and body.tied == [] and len(body) == 4
    check_params(body, model.transformer.parameters())
    with torch.no_grad():
        assert torch.equal(body(ids), model.transformer(ids).last_hidden_state)
