"""Models people bring, beyond the first nine families: decoders split by their
layout (Phi, Gemma, Gemma 2, Qwen3, Mixtral, StableLM, GPT-J), recipes for Falcon
(rotary or ALiBi), Bloom, DistilBERT, ELECTRA and DeiT, each bitwise equal to the
model's forward and trained bitwise like the plain loop; and the path for the
rest: a layout that does not match is refused, a hand-written list is checked
against its model, raw blocks and unsplit models are named."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_unseen_models import SGD, device
from torch import nn
from unseen_models import token_loss

import harmony
from harmony import Engine, Plan, reference_step
from harmony.engine.describe import microbatch_dependence
from harmony.errors import HarmonyError

transformers = pytest.importorskip("transformers")
hf_layers = pytest.importorskip("harmony.engine.hf.layers")

V, D, SEQ, IMAGE = 100, 32, 8, 8
B, U = 4, 2  # minibatch, microbatch of the training runs


def configs(p: float) -> dict:
    """name -> (model class, config, attention implementations the model offers): 2
    blocks, hidden 32; every dropout probability ``p``."""
    t, both = transformers, ("eager", "sdpa")
    text = {"vocab_size": V, "hidden_size": D, "num_hidden_layers": 2, "num_attention_heads": 4}
    text["max_position_embeddings"] = 16
    rotary = {**text, "intermediate_size": 64, "num_key_value_heads": 2, "attention_dropout": p}
    encoder = {**text, "intermediate_size": 64, "hidden_dropout_prob": p}
    encoder["attention_probs_dropout_prob"] = p
    distil = {"vocab_size": V, "dim": D, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}
    distil |= {"max_position_embeddings": 16, "dropout": p, "attention_dropout": p}
    falcon = {**text, "hidden_dropout": p, "attention_dropout": p}
    return {
        "phi": (t.PhiForCausalLM, t.PhiConfig(**rotary, resid_pdrop=p, embd_pdrop=p), both),
        "gemma": (t.GemmaForCausalLM, t.GemmaConfig(**rotary, head_dim=8), both),
        # a window shorter than the sequence in every other block; logits softcapped
        "gemma2": (
            t.Gemma2ForCausalLM,
            t.Gemma2Config(**rotary, head_dim=8, sliding_window=4, final_logit_softcapping=3.0),
            ("eager",),  # transformers offers Gemma 2 no sdpa
        ),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**rotary, head_dim=8), both),
        "mixtral": (
            t.MixtralForCausalLM,
            t.MixtralConfig(
                **rotary, num_local_experts=4, num_experts_per_tok=2, sliding_window=4
            ),
            both,
        ),
        "stablelm": (t.StableLmForCausalLM, t.StableLmConfig(**rotary, hidden_dropout=p), both),
        "gptj": (
            t.GPTJForCausalLM,
            t.GPTJConfig(
                vocab_size=V,
                n_embd=D,
                n_layer=2,
                n_head=4,
                rotary_dim=4,
                n_positions=16,
                resid_pdrop=p,
                embd_pdrop=p,
                attn_pdrop=p,
                bos_token_id=0,
                eos_token_id=0,
            ),
            both,
        ),
        "falcon": (t.FalconForCausalLM, t.FalconConfig(**falcon), both),
        "falcon-alibi": (t.FalconForCausalLM, t.FalconConfig(**falcon, alibi=True), both),
        "bloom": (
            t.BloomForCausalLM,
            t.BloomConfig(
                vocab_size=V,
                hidden_size=D,
                n_layer=2,
                n_head=4,
                hidden_dropout=p,
                attention_dropout=p,
            ),
            ("eager",),  # transformers offers Bloom no sdpa
        ),
        "distilbert-mlm": (t.DistilBertForMaskedLM, t.DistilBertConfig(**distil), both),
        "distilbert-cls": (
            t.DistilBertForSequenceClassification,
            t.DistilBertConfig(**distil, num_labels=3, seq_classif_dropout=p),
            both,
        ),
        # embeddings smaller than the blocks: projected in
        "electra-mlm": (t.ElectraForMaskedLM, t.ElectraConfig(**encoder, embedding_size=16), both),
        "electra-cls": (
            t.ElectraForSequenceClassification,
            t.ElectraConfig(**encoder, embedding_size=16, num_labels=3),
            both,
        ),
        "deit-cls": (
            t.DeiTForImageClassification,
            t.DeiTConfig(
                hidden_size=D,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=IMAGE,
                patch_size=4,
                num_labels=3,
                hidden_dropout_prob=p,
                attention_probs_dropout_prob=p,
            ),
            both,
        ),
    }


FAMILIES = list(configs(0.0))
CASES = [(name, attn) for name, (_, _, attns) in configs(0.0).items() for attn in attns]


def build(name: str, attn: str = "eager", p: float = 0.0, seed: int = 0) -> nn.Module:
    cls, config, _ = configs(p)[name]
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return cls(config)


def inputs(name: str, n: int, padded: bool, seed: int = 1) -> tuple:
    """Pixels, or token ids with (``padded``) every other sample padded at the end."""
    g = torch.Generator().manual_seed(seed)
    if name.startswith("deit"):
        return (torch.randn(n, 3, IMAGE, IMAGE, generator=g),)
    ids = torch.randint(2, V, (n, SEQ), generator=g)
    if not padded:
        return (ids,)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[::2, -3:] = 0
    return ids, mask


def model_logits(model, name: str, x: tuple):
    if name.startswith("deit"):
        return model(pixel_values=x[0]).logits
    extra = {"use_cache": False} if not name.startswith(("distilbert", "electra")) else {}
    return model(**dict(zip(("input_ids", "attention_mask"), x)), **extra).logits


# ---- the chain computes what the model computes -------------------------------------
@pytest.mark.parametrize("name, attn", CASES)
def test_chain_output_is_the_models(name, attn):
    model = build(name, attn).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # nothing transformers will drop
        chain = harmony.decompose(model)
        assert len(chain) == 4
        for padded in (False, True) if not name.startswith("deit") else (False,):
            x = inputs(name, 3, padded)
            with torch.no_grad():
                got, expected = chain(*x), model_logits(model, name, x)
            assert torch.equal(got, expected), f"max difference {(got - expected).abs().max()}"


def test_layout_names_the_models_own_parts():
    assert harmony.decompose(build("phi")).names == [
        "model.embed_tokens+embed_dropout",
        "model.layers.0",
        "model.layers.1",
        "model.final_layernorm+lm_head",
    ]
    assert harmony.decompose(build("gptj")).names[0] == "transformer.wte+drop"
    assert harmony.decompose(build("bloom")).names[0] == (
        "transformer.word_embeddings+word_embeddings_layernorm"
    )
    assert harmony.decompose(build("gemma")).tied == [(0, 3, "model.embed_tokens.weight")]


# ---- training through the engine ------------------------------------------------------
def batch(name: str, seed: int) -> tuple[tuple, torch.Tensor]:
    x = inputs(name, B, padded=True, seed=seed)
    labels = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))
    return x, labels if name.endswith("-cls") else torch.roll(x[0], -1, 1)


def train_both(name: str, n: int):
    steps = [batch(name, seed) for seed in (1, 2)]
    expected = build(name, p=0.1)  # every dropout on: masks must match the reference's
    opt = SGD(list(expected.parameters()))
    layers = list(harmony.decompose(expected))
    ref_losses = [
        reference_step(layers, token_loss, opt, x, y, U, step) for step, (x, y) in enumerate(steps)
    ]
    model = build(name, p=0.1)
    one_per_pack = Plan.uniform("harmony-pp", n, B, U, num_layers=len(layers), layers_per_pack=1)
    engine = Engine(model, SGD, token_loss, device=device(n), minibatch_size=B, plan=one_per_pack)
    losses = [engine.step(x, y) for x, y in steps]
    for (key, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), f"{key} differs"
    assert losses == ref_losses


#: trained in the quick run: sliding windows with softcapping, experts, ALiBi both ways,
#: an encoder with projected embeddings; the rest in the slow sweep
QUICK = ("gemma2", "mixtral", "falcon-alibi", "bloom", "electra-mlm")


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES]
)
def test_engine_trains_bitwise_like_the_plain_loop(name):
    train_both(name, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_trains_bitwise_on_two_gpus(name):
    train_both(name, 2)


# ---- a layout whose forward does more than its modules show --------------------------
def cohere() -> nn.Module:
    """Llama's modules, but a forward that scales the logits (``logit_scale``)."""
    t = transformers
    config = t.CohereConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        logit_scale=0.5,
    )
    torch.manual_seed(0)
    return t.CohereForCausalLM(config)


def test_a_forward_the_layout_does_not_describe_is_refused():
    message = r"chain of CohereForCausalLM does not compute what its forward computes"
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(cohere())
    with pytest.raises(HarmonyError, match=message):  # the engine never trains it wrong
        Engine(cohere(), SGD, token_loss, device=device(1), minibatch_size=B, plan="auto")


# ---- the rest: the calling convention, by hand (the README's example) ----------------
class Embed(nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids, attention_mask):
        return self.embed(input_ids), attention_mask


class Block(nn.Module):
    def __init__(self, block, rotary, config, masked: bool = True):
        super().__init__()
        self.block, self.masked = block, masked
        object.__setattr__(self, "rotary", rotary)  # constants, not this layer's
        object.__setattr__(self, "config", config)

    def forward(self, hidden_states, attention_mask):
        from transformers.masking_utils import create_causal_mask

        seq = hidden_states.shape[1]
        positions = torch.arange(seq, device=hidden_states.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=None,
            position_ids=positions,
        )
        out = self.block(
            hidden_states,
            attention_mask=mask if self.masked else None,
            position_ids=positions,
            position_embeddings=self.rotary(hidden_states, positions),
        )
        return out, attention_mask


class Head(nn.Module):
    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden_states, attention_mask):
        return self.lm_head(self.norm(hidden_states))


def llama() -> nn.Module:
    t = transformers
    config = t.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return t.LlamaForCausalLM(config)


def by_hand(model, masked=(True, True)) -> list[nn.Module]:
    body = model.model
    return [
        Embed(body.embed_tokens),
        *(Block(b, body.rotary_emb, model.config, m) for b, m in zip(body.layers, masked)),
        Head(body.norm, model.lm_head),
    ]


def test_a_hand_written_chain_is_checked_against_its_model():
    model, x = llama(), inputs("llama", 3, padded=True)
    chain = harmony.decompose(by_hand(model), reference=model, example_inputs=x)
    with torch.no_grad():
        assert torch.equal(chain(*x), model(*x, use_cache=False).logits)
    # the second block forgets the mask: it attends to later tokens and to padding
    message = r"first layer whose output differs .* is 2 \(2:Block\), against model\.layers\.1"
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(by_hand(model, (True, False)), reference=model, example_inputs=x)


def test_the_calling_convention_is_in_the_readme():
    from pathlib import Path

    from harmony.engine.decompose_checks import GUIDE

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = GUIDE.split("'")[1]
    assert f"#### {section}" in readme
    assert "harmony.decompose(blocks, reference=llama, example_inputs=(ids, mask))" in readme


def test_raw_transformers_blocks_are_named_with_what_they_miss():
    model = llama()
    body = model.model
    raw = [body.embed_tokens, *body.layers, body.norm, model.lm_head]
    message = r"element 1 of the list is a LlamaDecoderLayer .*without position_embeddings"
    with pytest.raises(HarmonyError, match=message):
        harmony.decompose(raw)


class Whole(nn.Module):
    """A whole transformers model in one module: nothing for the split to cut."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_a_model_that_splits_into_one_layer_is_warned_about():
    with pytest.warns(UserWarning, match=r"nothing was split in Whole: layer model holds \d+%"):
        chain = harmony.decompose(Whole(llama()))
    assert len(chain) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        harmony.decompose(llama())


# ---- a model whose forward depends on the microbatch ---------------------------------
def test_mixture_of_experts_keeps_forward_and_backward_microbatches_equal():
    model = build("mixtral")
    chain = harmony.decompose(model)
    assert "mixture-of-experts" in microbatch_dependence(chain.layers)
    unequal = Plan.uniform("harmony-pp", 1, B, 2, num_layers=4, layers_per_pack=1)
    unequal = Plan.from_dict({**unequal.to_dict(), "fwd_microbatch": 4})
    with pytest.raises(HarmonyError, match="must be equal .*mixture-of-experts"):
        Engine(model, SGD, token_loss, device=device(1), minibatch_size=B, plan=unequal)


def test_auto_plan_searches_one_microbatch_size_for_experts(monkeypatch):
    import harmony.engine.auto_plan as planning

    asked = {}

    def search(*args, **kwargs):
        asked.update(kwargs)
        raise HarmonyError("searched")

    monkeypatch.setattr(planning, "search", search)
    monkeypatch.setattr(planning, "profile", lambda *args, **kwargs: None)  # not timed here
    engine = Engine(
        build("mixtral"), SGD, token_loss, device=device(1), minibatch_size=B, plan="auto"
    )
    with pytest.raises(HarmonyError, match="searched"):
        engine.step(*batch("mixtral", 1))
    assert asked["equal_microbatches"] is True


@pytest.mark.slow
def test_auto_plan_for_mixture_of_experts_uses_one_microbatch_size():
    engine = Engine(
        build("mixtral"), SGD, token_loss, device=device(1), minibatch_size=B, plan="auto"
    )
    engine.step(*batch("mixtral", 1))
    assert engine.plan.fwd_microbatch == engine.plan.bwd_microbatch
