"""The model zoo: architectures against the authors' reference profiles, the
analytic cost model, and real training steps of the tiny models on CPU."""

from pathlib import Path

import pandas as pd
import pytest
import torch

import harmony
from harmony import zoo
from harmony.errors import HarmonyError

REFERENCE = Path(harmony.__file__).parent / "costs/data/reference/harmony-1080ti"
TINY = ["gpt2-tiny", "bert-tiny", "vgg-tiny", "resnet-tiny"]


def _params(layers):
    return sum(p.numel() for layer in layers for p in layer.parameters())


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


# ---- architectures vs the reference profiles ---------------------------------
@pytest.mark.parametrize(
    "name, params, vlayers",
    [
        ("gpt2-medium", 406_286_336, 28),
        ("gpt2-xl", 1_638_022_400, 52),
        ("gpt2-10b", 10_484_899_840, 54),
        ("gpt2-20b", 20_553_891_840, 104),
        ("gpt2-30b", 30_622_883_840, 154),
        ("gpt2-40b", 40_691_875_840, 204),
        ("bert-large", 335_143_938, 28),
        ("bert-96", 1_242_072_066, 100),
        ("vgg416", 577_894_184, 417),
        ("resnet1026", 801_800_232, 515),
    ],
)
def test_parameter_counts_and_depth_match_reference(name, params, vlayers):
    layers = zoo.build(name)
    assert len(layers) == vlayers
    assert _params(layers) == params
    s = zoo.spec(name)
    assert len(s) == vlayers and s.num_params == params


@pytest.mark.parametrize(
    "variant, name",
    [
        ("gpt2_xl", "gpt2-xl"),
        ("bert_large_seqlen512", "bert-large"),
        ("vgg416", "vgg416"),
        ("resnet1026", "resnet1026"),
    ],
)
def test_layers_match_reference_csv(variant, name):
    ref = pd.read_csv(REFERENCE / f"{variant}.layers.csv")
    s = zoo.spec(name)
    assert len(s) == len(ref)
    assert [c.param_numel for c in s.layers] == ref.param_count.tolist()
    # fp32 activations (4 B) plus int64 token / segment ids (8 B); BERT's first
    # layer also takes the float additive attention mask.
    assert [s.input_bytes(i, 1) for i in range(len(s))] == ref.input_bytes_per_sample.tolist()
    assert s.target_bytes(1) == ref.target_bytes_per_sample.iloc[-1]


def test_buffers_match_reference():
    gpt = zoo.spec("gpt2-xl")
    ref = pd.read_csv(REFERENCE / "gpt2_xl.layers.csv")
    # float causal masks
    assert [c.buffer_numel * 4 for c in gpt.layers] == ref.buffer_bytes.tolist()
    # BatchNorm's int64 step counter is 8 bytes in the reference, one element here.
    resnet = zoo.spec("resnet1026")
    ref = pd.read_csv(REFERENCE / "resnet1026.layers.csv")
    assert sum(c.buffer_numel for c in resnet.layers) * 4 == pytest.approx(
        ref.buffer_bytes.sum(), rel=0.01
    )


# ---- the cost model ----------------------------------------------------------
@pytest.mark.parametrize(
    "name, overrides", [("gpt2-xl", {}), ("gpt2-tiny", {"hidden": 128, "seq_len": 16})]
)
def test_gpt2_block_flops(name, overrides):
    cfg = zoo.MODELS[name].config
    s_len = overrides.get("seq_len", cfg.seq_len)
    h = overrides.get("hidden", cfg.hidden)
    block = zoo.spec(name, **overrides).layers[1]
    assert block.name == "GPT2Layer"
    assert block.fwd_flops_per_sample == pytest.approx(
        24 * s_len * h**2 + 4 * s_len**2 * h, rel=0.01
    )
    # recompute forward + backward (input and weight gradients): 3x the matmul FLOPs
    assert block.bwd_flops_per_sample == pytest.approx(3 * block.fwd_flops_per_sample, rel=0.01)


def test_first_layer_computes_no_input_gradient():
    layers = zoo.spec("vgg416").layers
    assert layers[0].fwd_flops_per_sample == 2 * 224 * 224 * 64 * 3 * 9
    assert layers[0].bwd_flops_per_sample == 2 * layers[0].fwd_flops_per_sample
    assert layers[1].bwd_flops_per_sample == 3 * layers[1].fwd_flops_per_sample


def test_working_memory_is_sized():
    s = zoo.spec("gpt2-xl")
    block, loss = s.layers[1], s.layers[-1]
    s_len, h, heads, vocab = 1024, 1600, 25, 50257
    out, scores = s_len * h * 4, heads * s_len * s_len * 4
    assert block.fwd_extra(1) >= out + scores  # output + the attention scores
    # attention probabilities and their dropout mask, at least
    assert block.bwd_extra(1) > 2 * scores
    assert block.bwd_extra(2) == 2 * block.bwd_extra(1)
    assert loss.bwd_extra(1) >= 2 * s_len * vocab * 4  # saved log-softmax + gradient of the logits
    assert all(
        c.fwd_time is None and c.bwd_time is None and c.update_time_s is None for c in s.layers
    )


def test_spec_fields():
    assert zoo.spec("gpt2-tiny").optimizer == "adamw"
    assert zoo.spec("bert-tiny").optimizer == "adam"
    assert zoo.spec("vgg-tiny").optimizer == zoo.spec("resnet-tiny").optimizer == "sgd-momentum"
    s = zoo.spec("gpt2-tiny", optimizer="sgd")
    assert s.optimizer == "sgd"
    assert s.source == "zoo:gpt2-tiny (analytic, meta device)"
    assert s.target_bytes_per_sample == 32 * 8
    assert (
        s.layers[0].input_fixed_bytes_per_sample == 32 * 8
        and s.layers[0].input_numel_per_sample == 0
    )


def test_spec_in_bfloat16_halves_activation_bytes():
    fp32, bf16 = zoo.spec("gpt2-tiny"), zoo.spec("gpt2-tiny", dtype="bfloat16")
    assert bf16.act_dtype == bf16.param_dtype == "bfloat16"
    assert bf16.weight_bytes() * 2 == fp32.weight_bytes()
    assert bf16.input_bytes(1, 1) * 2 == fp32.input_bytes(1, 1)
    assert bf16.layers[1].fwd_flops_per_sample == fp32.layers[1].fwd_flops_per_sample
    # within a few percent: dropout masks and integer indices do not shrink
    assert bf16.layers[1].bwd_extra(1) == pytest.approx(fp32.layers[1].bwd_extra(1) / 2, rel=0.05)


def test_overrides():
    assert len(zoo.build("gpt2-tiny", n_layer=4)) == 8
    assert zoo.spec("bert-tiny", seq_len=16).layers[1].input_numel_per_sample == 16 * 64 + 16
    with pytest.raises(HarmonyError, match="n_layers"):
        zoo.build("gpt2-tiny", n_layers=4)
    with pytest.raises(HarmonyError, match="multiple of heads"):
        zoo.spec("gpt2-tiny", hidden=66)
    with pytest.raises(HarmonyError, match="max_position"):
        zoo.spec("gpt2-tiny", seq_len=64)


def test_unknown_model_lists_the_zoo():
    with pytest.raises(HarmonyError) as err:
        zoo.spec("gpt3")
    assert all(name in str(err.value) for name in zoo.MODELS)
    with pytest.raises(HarmonyError):
        zoo.build("gpt3")


def test_gpt2_40b_on_meta_is_free_and_fast():
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    before = rss()
    layers = zoo.build("gpt2-40b")
    assert all(t.is_meta for layer in layers for t in [*layer.parameters(), *layer.buffers()])
    zoo.cost_model._MEASURED.clear()  # a cold measurement, not the cache of earlier tests
    s = zoo.spec("gpt2-40b")
    assert s.num_params == 40_691_875_840
    # fast because each structure is measured once: the 200 blocks share one measurement
    assert len(s.layers) == 204 and len(zoo.cost_model._MEASURED) <= 5
    assert rss() - before < 1 << 30  # the real weights alone would be 163 GB


# ---- the tiny models train for real on CPU -----------------------------------
@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_on_cpu(name):
    torch.manual_seed(0)
    layers = zoo.build(name, device="cpu")
    inputs, target = zoo.example_input(name, batch=2)
    assert target.dtype == torch.int64
    loss = zoo.forward(layers, inputs, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    params = [p for layer in layers for p in layer.parameters()]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("name", TINY)
def test_tiny_spec_agrees_with_real_run(name):
    """The meta-device spec sizes the inputs every layer really receives on CPU."""
    layers = zoo.build(name, device="cpu")
    inputs, target = zoo.example_input(name, batch=3)
    s = zoo.spec(name)
    assert [c.param_numel for c in s.layers] == [_params([layer]) for layer in layers]
    x = inputs
    with torch.no_grad():
        for i, layer in enumerate(layers[:-1]):
            assert sum(t.numel() * t.element_size() for t in x) == s.input_bytes(i, 3)
            x = _as_tuple(layer(*x))
    assert sum(t.numel() * t.element_size() for t in x) == s.input_bytes(len(layers) - 1, 3)
    assert target.numel() * target.element_size() == s.target_bytes(3)


def test_example_input_dtypes():
    (ids, types, mask), target = zoo.example_input("bert-tiny", batch=2)
    assert ids.dtype == types.dtype == torch.int64 and mask.dtype == torch.float32
    assert mask.shape == (2, 1, 1, 32) and target.shape == (2,)
    (ids,), target = zoo.example_input("gpt2-tiny", batch=2)
    assert ids.dtype == target.dtype == torch.int64 and ids.shape == target.shape == (2, 32)
    (images,), labels = zoo.example_input("resnet-tiny", batch=2)
    assert (
        images.dtype == torch.float32
        and images.shape == (2, 3, 64, 64)
        and labels.dtype == torch.int64
    )
