"""What the teaching notebooks in ``notebooks/lessons/`` compute, so that each
lesson stays markdown and short calls.

* Lessons 1 to 4 play plans in the simulator, on a reference model (the
  per-layer profiles the Harmony authors measured on GTX 1080 Ti GPUs, or the
  zoo's analytic costs) and a server preset: why swapping per microbatch moves
  so many bytes (:func:`closed_form`, :func:`bytes_table`), input-batch
  grouping (:func:`grouping_sweep`), just-in-time scheduling and the CPU
  update (:func:`scheduling_sweep`, :func:`update_overlap`, :func:`pack_story`),
  many GPUs (:func:`wirings`, :func:`scaling_sweep`).
* Lesson 5 trains the zoo's small GPT-2 on real text shipped with Python
  (:func:`load_corpus`, :func:`char_gpt2`), with the engine on an emulated GPU
  next to the plain PyTorch loop
  (:func:`~harmony.workbench.experiments.train_side_by_side`), and shows what
  keeps it exact and what does not (:func:`dropout_masks`, :func:`exactness_table`).

:func:`try_this` puts a computation behind ipywidgets controls and shows its
first result at once (:func:`readable` tables). The baseline is
:data:`~harmony.workbench.experiments.BASELINE` (per-layer swapping as vDNN / LMS run
it); lessons about input-batch grouping alone compare with
:data:`~harmony.workbench.experiments.ABLATION` (Harmony without grouping).
"""

from .common import (
    COMPUTE_KINDS,
    DATA_PARALLEL,
    HOST_KINDS,
    LEGEND,
    PIPELINE,
    compute_s,
    lesson_plan,
    play,
    policy_label,
    policy_scale,
    readable,
    summary_table,
    try_this,
    with_cpu,
    with_link,
)
from .exactness import (
    Corpus,
    char_gpt2,
    dropout_masks,
    exactness_table,
    footprint_bytes,
    generate,
    load_corpus,
    loss_lines,
)
from .grouping import grouping_chart, grouping_sweep, task_counts, timelines
from .many_gpus import describe_servers, scaling_lesson_chart, scaling_sweep, wirings
from .scheduling import (
    gpu_idle_s,
    idle_gaps,
    pack_story,
    scheduling_chart,
    scheduling_sweep,
    update_overlap,
)
from .swapping import (
    bytes_chart,
    bytes_table,
    closed_form,
    engine_bytes,
    link_chart,
    link_sweep,
    model_overview,
    passes_counted,
    weight_passes,
)

__all__ = [
    "COMPUTE_KINDS",
    "Corpus",
    "DATA_PARALLEL",
    "HOST_KINDS",
    "LEGEND",
    "PIPELINE",
    "bytes_chart",
    "bytes_table",
    "char_gpt2",
    "closed_form",
    "compute_s",
    "describe_servers",
    "dropout_masks",
    "engine_bytes",
    "exactness_table",
    "footprint_bytes",
    "generate",
    "gpu_idle_s",
    "grouping_chart",
    "grouping_sweep",
    "idle_gaps",
    "link_chart",
    "lesson_plan",
    "link_sweep",
    "load_corpus",
    "loss_lines",
    "model_overview",
    "pack_story",
    "passes_counted",
    "play",
    "policy_label",
    "policy_scale",
    "readable",
    "scaling_lesson_chart",
    "scaling_sweep",
    "scheduling_chart",
    "scheduling_sweep",
    "summary_table",
    "task_counts",
    "timelines",
    "try_this",
    "update_overlap",
    "weight_passes",
    "wirings",
    "with_cpu",
    "with_link",
]
