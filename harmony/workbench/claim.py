"""Whether the paper's claim applies to an explorer's setting, and why, in words.

Harmony's claim is about models larger than a GPU's memory: their weights,
gradients and optimizer state must be swapped, and Harmony swaps far less
than per-layer swapping does. When the model fits in one GPU, nothing needs
swapping: the run to beat is then the model kept resident (on one GPU,
:mod:`harmony.policies.model_parallel` is exactly that), not a swapping
baseline. :func:`setting` says which case a setting is, from the spec, the
hardware and the simulator, never from the model's name.
"""

from __future__ import annotations

import pandas as pd

from ..costs.hardware import format_bytes, preset
from ..policies import model_parallel
from .comparison import times
from .play import cached_spec, own_plan, own_summary

#: the policy that keeps the whole model resident (on one GPU: plain training)
RESIDENT = model_parallel.NAME


def claim_setting(model: str, source: str, hardware: str, minibatch: int) -> tuple:
    """The arguments of :func:`~.play.own_plan` for the resident run :func:`setting`
    compares with: on one GPU of ``hardware``, the preset's host memory, no disk."""
    return (RESIDENT, model, source, hardware, 1, minibatch, None, None)


def setting(
    comparison: pd.DataFrame,
    chosen: str,
    model: str,
    source: str,
    hardware: str,
    minibatch: int,
    n_gpus: int,
) -> str:
    """One sentence: the paper's setting (the model does not fit in a GPU, so
    it must be swapped), or why the claim does not apply (it fits: a GPU
    trains it with nothing swapped, and on one GPU how the chosen plan of
    ``comparison`` compares with that)."""
    spec, hw = cached_spec(model, source), preset(hardware)
    state = spec.weight_bytes() + spec.grad_bytes() + spec.optimizer_state_bytes()
    held = f"{format_bytes(state)} of weights, gradients and optimizer state"
    resident, _ = own_plan(*claim_setting(model, source, hardware, minibatch))
    if resident is None:
        return (
            f"The paper's setting: the model does not fit in a GPU ({held}; a GPU holds "
            f"{format_bytes(hw.gpu_memory)}), so it must be swapped"
        )
    text = (
        f"The paper's claim does not apply: the model fits in a GPU ({held}, and the "
        f"activations of microbatch {resident.bwd_microbatch}, in {format_bytes(hw.gpu_memory)}), "
        "so nothing needs swapping"
    )
    summary, _ = own_summary(model, source, hw, resident)
    me = comparison.set_index("policy").loc[chosen]
    # only on one GPU is the resident run the one to compare with (on more, data parallel is)
    if n_gpus == 1 and chosen != RESIDENT and summary is not None and me.fits:
        faster = times(me.iteration_s / summary.iteration_s, "faster", "slower")
        text += f": {RESIDENT}, which keeps it all on the GPU, is {faster} than {chosen}"
    return text
