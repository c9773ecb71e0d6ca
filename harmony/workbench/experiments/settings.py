"""Each experiment's parameters, read from its ``experiments/<name>.yaml``
(the one place they are written), and the servers the simulated figures use."""

from __future__ import annotations

from typing import Any

from ...costs.hardware import Hardware, preset
from ...errors import HarmonyError
from ...policies import names
from ..reproduce import EXPERIMENTS_DIR, load_experiment

HARDWARE = "paper-4x1080ti"
HARDWARE_8 = "paper-8x1080ti"
HARMONY_POLICIES = tuple(names("harmony"))
#: the baseline the figures and lessons hold Harmony against: per-layer swapping as vDNN /
#: LMS run it, planned by its own chooser (harmony.planner.systems.choose_layer_swap)
BASELINE = "layer-swap"
#: where the baseline keeps training state, as a framework with virtualized GPU memory does:
#: gradient sums and the optimizer on the GPU, swapped (the options its chooser sets)
BASELINE_STATE = {"gpu_gradients": True, "gpu_optimizer": True}
#: the systems that virtualize GPU memory as their authors run them (the paper's baselines)
BASELINES = (BASELINE, "gpipe-swap")
#: Harmony without input-batch grouping: an ablation, shown beside the baselines, never as one
ABLATION = "harmony-no-grouping"
PAPER_MODELS = ["bert-96", "gpt2-xl", "vgg416", "resnet1026"]


def settings(experiment: str, quick: bool, **given: Any) -> dict[str, Any]:
    """The parameters of ``experiment``: each one ``given`` that is not None,
    else its value in the experiment's YAML for the mode (``quick`` or full)."""
    path = EXPERIMENTS_DIR / f"{experiment}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
        raise HarmonyError(f"unknown experiment {experiment!r}; known: {', '.join(known)}")
    out = load_experiment(path).params(full=not quick)
    out.pop("quick", None)  # the mode itself, not a setting
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def hardware_for(n_gpus: int, hardware: str = HARDWARE) -> Hardware:
    """The paper's 4-GPU server for up to 4 GPUs, its 8-GPU configuration beyond."""
    hw = preset(hardware)
    if n_gpus > hw.n_gpus and hardware == HARDWARE:
        hw = preset(HARDWARE_8)
    if n_gpus > hw.n_gpus:
        raise HarmonyError(f"{hw.name} has {hw.n_gpus} GPUs, {n_gpus} asked")
    return hw
