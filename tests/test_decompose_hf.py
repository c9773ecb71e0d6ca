"""Models people bring: Hugging Face transformers of the common families and a
torchvision-style ResNet split by ``decompose`` without hand wrapping. Each chain
computes bitwise what the model's forward computes (padding masks included),
reports tied weights, and trains through the engine bitwise like the plain loop."""

from __future__ import annotations

import pytest
import torch
from test_unseen_models import SGD, device
from torch import nn
from unseen_models import token_loss

import harmony
from harmony import Engine, Plan, reference_step
from harmony.errors import HarmonyError

transformers = pytest.importorskip("transformers")
hf_layers = pytest.importorskip("harmony.engine.hf.layers")

V, D, SEQ, IMAGE = 100, 32, 8, 8
B, U = 4, 2  # minibatch, microbatch of the training runs


def configs(p: float) -> dict:
    """name -> (model class, config): 2 blocks, hidden 32; every dropout probability ``p``."""
    t = transformers
    text = {
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
    }
    rotary = {**text, "intermediate_size": 64, "num_key_value_heads": 2, "attention_dropout": p}
    encoder = {
        **text,
        "intermediate_size": 64,
        "hidden_dropout_prob": p,
        "attention_probs_dropout_prob": p,
    }
    roberta = {**encoder, "max_position_embeddings": 18}  # positions start after the padding id
    vit = {
        "hidden_size": D,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "image_size": IMAGE,
        "patch_size": 4,
        "hidden_dropout_prob": p,
        "attention_probs_dropout_prob": p,
    }
    gpt2 = t.GPT2Config(
        n_layer=2,
        n_embd=D,
        n_head=4,
        vocab_size=V,
        n_positions=16,
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        bos_token_id=0,
        eos_token_id=0,
    )
    return {
        "gpt2": (t.GPT2LMHeadModel, gpt2),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**rotary, tie_word_embeddings=True)),
        "llama-bare": (t.LlamaModel, t.LlamaConfig(**rotary)),
        # windows shorter than the sequence: Mistral's in every block, Qwen2's in the second
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**rotary, sliding_window=4)),
        "qwen2": (
            t.Qwen2ForCausalLM,
            t.Qwen2Config(
                **rotary, use_sliding_window=True, sliding_window=4, max_window_layers=1
            ),
        ),
        # embeddings projected in and out (word_embed_proj_dim < hidden), the LM head tied to them
        "opt": (
            t.OPTForCausalLM,
            t.OPTConfig(
                **text, ffn_dim=64, word_embed_proj_dim=16, dropout=p, attention_dropout=p
            ),
        ),
        "gpt-neox": (
            t.GPTNeoXForCausalLM,
            t.GPTNeoXConfig(**text, intermediate_size=64, hidden_dropout=p, attention_dropout=p),
        ),
        "bert-mlm": (t.BertForMaskedLM, t.BertConfig(**encoder)),
        "bert": (t.BertModel, t.BertConfig(**encoder)),  # with its pooler
        "bert-cls": (t.BertForSequenceClassification, t.BertConfig(**encoder, num_labels=3)),
        "roberta-mlm": (t.RobertaForMaskedLM, t.RobertaConfig(**roberta)),
        "roberta-cls": (
            t.RobertaForSequenceClassification,
            t.RobertaConfig(**roberta, num_labels=3),
        ),
        "vit-cls": (t.ViTForImageClassification, t.ViTConfig(**vit, num_labels=3)),
        "vit": (t.ViTModel, t.ViTConfig(**vit)),
    }


FAMILIES = list(configs(0.0))
DECODERS = {"gpt2", "llama", "llama-bare", "mistral", "qwen2", "opt", "gpt-neox"}


def build(name: str, attn: str = "sdpa", p: float = 0.0, seed: int = 0) -> nn.Module:
    cls, config = configs(p)[name]
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return cls(config)


def inputs(name: str, n: int, padded: bool, seed: int = 1) -> tuple:
    """The chain's inputs: pixels, or token ids with a padding mask (every other
    sample padded at the end) when ``padded``."""
    g = torch.Generator().manual_seed(seed)
    if name.startswith("vit"):
        return (torch.randn(n, 3, IMAGE, IMAGE, generator=g),)
    ids = torch.randint(2, V, (n, SEQ), generator=g)  # 0 and 1 are special (RoBERTa pads with 1)
    if not padded:
        return (ids,)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[::2, -3:] = 0
    return ids, mask


def model_output(model, name: str, x: tuple, **kwargs):
    """What the model's own forward returns that the chain returns."""
    keys = ("pixel_values",) if name.startswith("vit") else ("input_ids", "attention_mask")
    out = model(**dict(zip(keys, x)), **kwargs)
    if name in ("bert", "vit"):
        return out.last_hidden_state, out.pooler_output
    return out.logits if "logits" in out else out.last_hidden_state


def check_params(chain, model: nn.Module):
    """The chain holds the model's own Parameter objects, each in one layer unless tied."""
    tied = {(i, j) for i, j, _ in chain.tied}
    where: dict[int, list[int]] = {}
    for i, layer in enumerate(chain.layers):
        for p in layer.parameters():
            where.setdefault(id(p), []).append(i)
    assert set(where) == {id(p) for p in model.parameters()}
    assert all((owners[0], j) in tied for owners in where.values() for j in owners[1:])


# ---- the chain computes what the model computes -----------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_chain_output_is_the_models(name, attn):
    model = build(name, attn).eval()
    chain = harmony.decompose(model)
    check_params(chain, model)
    for padded in (False, True) if not name.startswith("vit") else (False,):
        x = inputs(name, 3, padded)
        # decoders: the forward without a KV cache, as training runs it
        extra = {"use_cache": False} if name in DECODERS else {}
        with torch.no_grad():
            got, expected = chain(*x), model_output(model, name, x, **extra)
            if name in DECODERS:
                # The default forward (use_cache=True) copies keys and values into a cache: under
                # eager attention the same matmuls then read other strides and round differently.
                default = model_output(model, name, x)
                torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-6)
        if isinstance(expected, tuple):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        else:
            assert torch.equal(got, expected), f"max difference {(got - expected).abs().max()}"


@pytest.mark.parametrize(
    "name, tied",
    [
        ("gpt2", [(0, 3, "transformer.wte.weight")]),
        ("llama", [(0, 3, "model.embed_tokens.weight")]),
        ("opt", [(0, 3, "model.decoder.embed_tokens.weight")]),
        ("bert-mlm", [(0, 3, "bert.embeddings.word_embeddings.weight")]),
        ("roberta-mlm", [(0, 3, "roberta.embeddings.word_embeddings.weight")]),
        ("mistral", []),
        ("gpt-neox", []),
        ("bert-cls", []),
        ("vit-cls", []),
    ],
)
def test_tied_weights_are_reported(name, tied):
    chain = harmony.decompose(build(name))
    assert chain.tied == tied


def test_layer_names_follow_the_model():
    assert harmony.decompose(build("llama")).names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm+lm_head",
    ]
    assert harmony.decompose(build("opt")).names == [
        "model.decoder.embed_tokens+embed_positions+project_in",
        "model.decoder.layers.0",
        "model.decoder.layers.1",
        "model.decoder.final_layer_norm+project_out+lm_head",
    ]
    assert harmony.decompose(build("bert")).names[-1] == "pooler"
    assert harmony.decompose(build("vit-cls")).names == [
        "vit.embeddings",
        "vit.layers.0",
        "vit.layers.1",
        "vit.layernorm+classifier",
    ]


# ---- a torchvision-style ResNet written with plain modules -------------------------
class BasicBlock(nn.Module):
    """torchvision's ResNet basic block, with a projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout: stem, stages of basic blocks, pool, flatten, fc."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 8, 1))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16, 1))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d((1, 1)), nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_torchvision_style_resnet_splits_through_fx():
    torch.manual_seed(0)
    model = ResNet().eval()
    chain = harmony.decompose(model)
    # the in-place ReLU stays with the layer before it; flatten goes with avgpool
    assert chain.names == [
        "conv1",
        "bn1+relu",
        "maxpool",
        "layer1.0",
        "layer1.1",
        "layer2.0",
        "layer2.1",
        "avgpool",
        "fc",
    ]
    assert chain[3] is model.layer1[0] and chain.tied == []
    check_params(chain, model)
    x = torch.randn(3, 3, IMAGE, IMAGE)
    with torch.no_grad():
        assert torch.equal(chain(x), model(x))


def test_in_place_activation_joins_the_layer_before_it():
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )
    chain = harmony.decompose(features)
    assert chain.names == ["0+1", "2+3", "4"]
    assert list(chain[0]) == [features[0], features[1]]
    x = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        assert torch.equal(chain(x), features(x))


# ---- training through the engine ---------------------------------------------------
def batch(name: str, seed: int) -> tuple[tuple, torch.Tensor]:
    """A minibatch: images or padded token ids, with class labels or next tokens."""
    x = (
        (torch.randn(B, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed)),)
        if (name == "resnet")
        else inputs(name, B, padded=True, seed=seed)
    )
    labels = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))
    return x, labels if name.endswith(("-cls", "resnet")) else torch.roll(x[0], -1, 1)


def trainable(name: str) -> nn.Module:
    if name == "resnet":
        torch.manual_seed(0)
        return ResNet()
    return build(name, p=0.1)  # every dropout on: masks must match the reference's


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "llama",
        "mistral",
        "qwen2",
        "opt",
        "gpt-neox",
        "bert-mlm",
        "roberta-cls",
        "vit-cls",
        "resnet",
    ],
)
def test_engine_trains_bitwise_like_the_plain_loop(name, n):
    steps = [batch(name, seed) for seed in (1, 2)]
    expected = trainable(name)
    opt = SGD(list(expected.parameters()))
    layers = list(harmony.decompose(expected))
    ref_losses = [
        reference_step(layers, token_loss, opt, x, y, U, step) for step, (x, y) in enumerate(steps)
    ]
    model = trainable(name)
    one_per_pack = Plan.uniform("harmony-pp", n, B, U, num_layers=len(layers), layers_per_pack=1)
    engine = Engine(model, SGD, token_loss, device=device(n), minibatch_size=B, plan=one_per_pack)
    losses = [engine.step(x, y) for x, y in steps]
    for (key, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), f"{key} differs"
    assert losses == ref_losses


# ---- models that cannot be split ----------------------------------------------------
def test_unsupported_class_names_itself_and_the_way_out():
    config = transformers.GPT2Config(
        n_layer=1, n_embd=D, n_head=4, vocab_size=V, bos_token_id=0, eos_token_id=0
    )
    message = (
        r"GPT2ForSequenceClassification .*recipe \(GPT-2, OPT.*Llama's layout"
        r".*README.md, section 'Your own blocks: the calling convention'"
    )
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(transformers.GPT2ForSequenceClassification(config))


def test_missing_part_is_named():
    model = build("llama")
    del model.model.rotary_emb
    with pytest.raises(HarmonyError, match=r"LlamaForCausalLM: it has no model\.rotary_emb"):
        harmony.decompose(model)


def test_random_layer_skipping_is_refused():
    model = build("opt")
    model.model.decoder.layerdrop = 0.1
    message = r"OPTForCausalLM: model\.decoder\.forward skips blocks.*layerdrop"
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(model)


def test_example_inputs_check_the_chain_against_the_model(monkeypatch):
    model = build("llama", "eager")
    ids = inputs("llama", 2, padded=True)
    assert len(harmony.decompose(model, example_inputs=ids)) == 4

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.layers[1], "forward", broken)
    message = r"LlamaForCausalLM: layer model\.layers\.1 \(HFBlock\) failed.*boom"
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(model, example_inputs=ids)
    monkeypatch.undo()
    # a chain that does not mask causally computes something else, and says so
    monkeypatch.setattr(hf_layers, "create_causal_mask", lambda **kwargs: None)
    with pytest.raises(HarmonyError, match="chain of LlamaForCausalLM does not compute what its"):
        harmony.decompose(model, example_inputs=ids)
