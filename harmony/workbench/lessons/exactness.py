"""Lesson 5: exactness, on real text shipped with Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch

from ...engine import EmulatedDevice, EmulatedServer
from ...engine.reference_loop import as_args, seed_layer
from ...errors import HarmonyError
from ...plan import Plan
from .. import charts
from ..experiments import BASELINE, BASELINE_STATE, TrainingRun, train_side_by_side
from ..training import build_model
from .common import (
    DATA_PARALLEL,
    PIPELINE,
)


# ---- lesson 5: exactness, on real text ---------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """A text as a character-level dataset: ``chars`` is the vocabulary (sorted)."""

    name: str
    text: str
    chars: str

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batches(self, n: int, minibatch: int, seq_len: int, seed: int = 0) -> list[tuple]:
        """``n`` minibatches of ``minibatch`` windows of ``seq_len`` characters
        at random places (a function of ``seed``): (inputs, next characters)."""
        ids = self.encode(self.text)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            starts = torch.randint(0, len(ids) - seq_len - 1, (minibatch,), generator=gen)
            x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
            y = torch.stack([ids[s + 1 : s + seq_len + 1] for s in starts.tolist()])
            out.append((x, y))
        return out


def load_corpus() -> Corpus:
    """Python's own help texts (``pydoc_data.topics``, shipped with CPython: the
    language reference's sections as plain text), as one character-level corpus."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return Corpus("pydoc_data.topics", text, "".join(sorted(set(text))))


def char_gpt2(
    corpus: Corpus, seed: int = 0, dropout: float = 0.1, n_layer: int = 2, seq_len: int = 32
):
    """The zoo's ``gpt2-tiny`` sized for ``corpus`` (one token per character), on
    the CPU, without its loss layer, initialised from ``seed``."""
    return build_model(
        "gpt2-tiny",
        seed,
        vocab=corpus.vocab,
        dropout=dropout,
        n_layer=n_layer,
        seq_len=seq_len,
        max_position=max(seq_len, 32),
    )


def loss_lines(losses: pd.DataFrame, title: str = ""):
    """The two loss curves of a
    :func:`~harmony.workbench.experiments.train_side_by_side` run, each labelled in the legend
    (:func:`harmony.workbench.charts.loss_chart`: equal curves show as a dashed
    line inside a broad one)."""
    return charts.loss_chart(
        losses,
        title,
        runs={
            "reference": "plain PyTorch loop (harmony.reference_step)",
            "engine": "harmony.Engine on the emulated GPU",
        },
    )


def footprint_bytes(model) -> float:
    """Bytes of weights, gradients and AdamW's two moments: training state but activations."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def generate(model, corpus: Corpus, prompt: str, n_chars: int = 80) -> str:
    """``prompt`` continued by ``n_chars`` characters, each the model's most likely
    next one given the characters before it, as many as the model has positions
    (dropout off while it writes)."""
    window = model[0].wpe.num_embeddings
    ids = corpus.encode(prompt).tolist()
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(n_chars):
                h = (torch.tensor([ids[-window:]]),)
                for layer in model:
                    h = as_args(layer(*h))
                ids.append(int(h[0][0, -1].argmax()))
    finally:
        model.train()
    return corpus.decode(ids)


def dropout_masks(
    seed: int = 0,
    step: int = 3,
    first_sample: int = 4,
    layer: int = 1,
    p: float = 0.1,
    shape: Sequence[int] = (4, 32, 64),
) -> pd.DataFrame:
    """Dropout masks drawn the engine's way: the CPU generator is seeded with
    (seed, step, first sample of the microbatch, layer) just before a layer
    runs, in the forward pass and again in the recompute. One row per draw:
    whether its mask equals the forward pass's, and the share of zeros."""

    def mask(s: int, st: int, a: int, lay: int) -> torch.Tensor:
        seed_layer(s, st, a, lay)
        return torch.nn.functional.dropout(torch.ones(*shape), p) == 0

    forward = mask(seed, step, first_sample, layer)
    draws = [
        (
            "recompute in the backward pass (same seed, step, sample, layer)",
            mask(seed, step, first_sample, layer),
        ),
        (
            "the next microbatch (first sample + its size)",
            mask(seed, step, first_sample + shape[0], layer),
        ),
        ("the same microbatch at the next step", mask(seed, step + 1, first_sample, layer)),
        ("the next layer", mask(seed, step, first_sample, layer + 1)),
        ("another seed", mask(seed + 1, step, first_sample, layer)),
    ]
    return pd.DataFrame(
        [
            {
                "draw": what,
                "same_mask_as_forward": bool(torch.equal(m, forward)),
                "zeros": float(m.float().mean()),
            }
            for what, m in draws
        ]
    )


def exactness_table(
    corpus: Corpus,
    batches: Sequence[tuple],
    microbatch: int,
    layers_per_pack: int,
    dropout: float,
    memory: str,
    bandwidth: str,
    lr: float,
    seed: int = 0,
    n_layer: int = 2,
    gpus: int = 2,
    threads: int | None = 1,
) -> pd.DataFrame:
    """The engine against the plain loop under several plans on ``batches``:
    what is expected, and what happened (max |loss difference|, max |weight
    difference|, bitwise equal). A plan the engine refuses gets its reason."""
    minibatch, seq_len = batches[0][0].shape
    n = len(char_gpt2(corpus, seed, 0.0, n_layer, seq_len))
    one = EmulatedDevice(memory=memory, h2d=bandwidth, d2h=bandwidth)
    many = EmulatedServer(gpus=gpus, memory=memory, h2d=bandwidth, d2h=bandwidth)
    variants = _variants(minibatch, microbatch, n, layers_per_pack, dropout, gpus, one, many)
    rows = []
    for name, expected, p, device, chosen in variants:
        row = {"variant": name, "plan": chosen.describe(), "dropout": p, "expected": expected}
        try:
            run = train_side_by_side(
                len(batches),
                minibatch,
                device,
                chosen,
                lr=lr,
                seed=seed,
                threads=threads,
                batches=batches,
                model=lambda p=p: char_gpt2(corpus, seed, p, n_layer, seq_len),
            )
        except HarmonyError as e:
            rows.append({**row, "outcome": f"refused: {e}"})
            continue
        rows.append(
            {
                **row,
                "outcome": _outcome(run),
                "max_loss_diff": run.max_loss_diff,
                "max_weight_diff": run.max_weight_diff,
                "bitwise_equal": run.bitwise_equal,
            }
        )
    return pd.DataFrame(rows)


def _variants(
    minibatch: int,
    microbatch: int,
    n: int,
    layers_per_pack: int,
    dropout: float,
    gpus: int,
    one: EmulatedDevice,
    many: EmulatedServer,
) -> list[tuple[str, str, float, object, Plan]]:
    """:func:`exactness_table`'s rows to be: (name, what is expected, dropout, device,
    plan) for a model of ``n`` layers."""

    def plan(policy: str, n_gpus: int = 1, fwd: int | None = None) -> Plan:
        return Plan.uniform(
            policy, n_gpus, minibatch, microbatch, n, layers_per_pack, fwd_microbatch=fwd
        )

    twice = min(2 * microbatch, minibatch)
    return [
        (f"{PIPELINE} x1, uF = uB", "bitwise", dropout, one, plan(PIPELINE)),
        (f"{BASELINE} x1", "bitwise", dropout, one, plan(BASELINE).with_options(**BASELINE_STATE)),
        (f"{PIPELINE} x{gpus}", "bitwise", dropout, many, plan(PIPELINE, gpus)),
        (
            f"{DATA_PARALLEL} x{gpus}",
            "close: per-GPU gradients summed in another order",
            dropout,
            many,
            plan(DATA_PARALLEL, gpus),
        ),
        (
            f"{PIPELINE} x1, uF = {twice}, uB = {microbatch}, dropout {dropout}",
            "refused: recompute could not redraw the forward's masks",
            dropout,
            one,
            plan(PIPELINE, fwd=twice),
        ),
        (
            f"{PIPELINE} x1, uF = {twice}, uB = {microbatch}, no dropout",
            "close, not promised bitwise: the forward runs on other batch shapes",
            0.0,
            one,
            plan(PIPELINE, fwd=twice),
        ),
    ]


def _outcome(run: TrainingRun) -> str:
    """bitwise (losses and final weights), close (losses equal to float32
    rounding: 1e-5 relative) or different."""
    if run.bitwise_equal:
        return "bitwise"
    scale = float(run.losses["reference"].abs().max())
    return "close" if run.max_loss_diff <= 1e-5 * scale else "different"
