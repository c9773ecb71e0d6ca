"""What the notebooks compute: one function per figure of the Harmony paper
(VLDB 2022) returning tables, charts of those tables, and writing results.

The notebooks in ``notebooks/`` are thin glue over this package: a parameters
cell, :func:`settings` (each experiment's parameters live in its
``experiments/<name>.yaml``), calls to these functions, :func:`write_outputs`.

* :mod:`.simulated`: figures played in the simulator on the per-layer profiles
  the Harmony authors measured on GTX 1080 Ti GPUs (swap volume, throughput,
  pack x microbatch grid, the planner's table, scaling, every system);
* :mod:`.measured`: figures the engine measures on emulated GPUs (training
  side by side with the plain loop, exactness, simulator fidelity, PyTorch's
  own offload);
* :mod:`.figures`: their charts; :mod:`.outputs`: results on disk.
"""

from .figures import (
    fidelity_chart,
    heatmap_chart,
    scaling_chart,
    search_time_chart,
    swap_volume_chart,
    systems_chart,
    throughput_chart,
    torch_offload_chart,
)
from .measured import (
    TrainingRun,
    activation_bytes,
    adamw,
    baseline_comparison,
    emulated_throughput,
    exactness_variants,
    fidelity_grid,
    gpt2_tiny,
    median_step_s,
    synthetic_batches,
    train_side_by_side,
    training_footprint,
)
from .outputs import write_outputs
from .settings import (
    BASELINE,
    HARDWARE,
    HARDWARE_8,
    HARMONY_POLICIES,
    PAPER_MODELS,
    hardware_for,
    settings,
)
from .simulated import (
    Best,
    best_plans,
    depth_grid_jobs,
    pack_microbatch_grid,
    planner_table,
    scaling_table,
    schedules_table,
    swap_volume_table,
    systems_table,
    throughput_table,
)
from .vs_torch import gpt2_config, torch_offload_comparison

__all__ = [
    "BASELINE",
    "Best",
    "HARDWARE",
    "HARDWARE_8",
    "HARMONY_POLICIES",
    "PAPER_MODELS",
    "TrainingRun",
    "activation_bytes",
    "adamw",
    "baseline_comparison",
    "best_plans",
    "depth_grid_jobs",
    "emulated_throughput",
    "exactness_variants",
    "fidelity_chart",
    "fidelity_grid",
    "gpt2_config",
    "gpt2_tiny",
    "hardware_for",
    "heatmap_chart",
    "median_step_s",
    "pack_microbatch_grid",
    "planner_table",
    "scaling_chart",
    "scaling_table",
    "schedules_table",
    "search_time_chart",
    "settings",
    "swap_volume_chart",
    "swap_volume_table",
    "synthetic_batches",
    "systems_chart",
    "systems_table",
    "throughput_chart",
    "throughput_table",
    "torch_offload_chart",
    "torch_offload_comparison",
    "train_side_by_side",
    "training_footprint",
    "write_outputs",
]
