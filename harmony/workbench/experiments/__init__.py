"""What the notebooks compute: one function per figure of the Harmony paper
(VLDB 2022) returning tables, charts of those tables, and writing results.

The notebooks in ``notebooks/`` are thin glue over this package: a parameters
cell, :func:`settings` (each experiment's parameters live in its
``experiments/<name>.yaml``), calls to these functions, :func:`write_outputs`.

* :mod:`.paper_grid` and :mod:`.simulated`: figures played in the simulator on
  the per-layer profiles the Harmony authors measured on GTX 1080 Ti GPUs
  (Harmony against the paper's baselines over the paper's grid; the pack x
  microbatch grid, the planner's table, scaling, every system, KARMA's and
  HYDRA's comparisons);
* :mod:`.ladder`: the ablation ladder, from per-layer swapping to Harmony one
  technique at a time;
* :mod:`.measured`: figures the engine measures on emulated GPUs (training
  side by side with the plain loop, exactness, simulator fidelity, throughput);
* :mod:`.vs_torch`: PyTorch's own offload recipe against Harmony;
* :mod:`.figures`: their charts; :mod:`.outputs`: results on disk.

The baseline is :data:`BASELINE` (per-layer swapping as vDNN / LMS run it),
with :data:`BASELINES` the systems that virtualize GPU memory; :data:`ABLATION`
(Harmony without input-batch grouping) is shown beside them, labelled as such.
"""

from .figures import (
    fidelity_chart,
    heatmap_chart,
    hydra_chart,
    karma_chart,
    ladder_chart,
    scaling_chart,
    search_time_chart,
    swap_volume_chart,
    system_bars,
    systems_chart,
    throughput_chart,
    torch_offload_chart,
)
from .ladder import RUNGS, ablation_ladder, ladder_claims, ladder_plans
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
from .paper_grid import Best, best_plans, grid_claims, paper_grid, versus_baselines
from .settings import (
    ABLATION,
    BASELINE,
    BASELINE_STATE,
    BASELINES,
    HARDWARE,
    HARDWARE_8,
    HARMONY_POLICIES,
    PAPER_MODELS,
    hardware_for,
    settings,
)
from .simulated import (
    HYDRA_BASELINES,
    OUT_OF_CORE,
    depth_grid_jobs,
    hydra_table,
    karma_table,
    pack_microbatch_grid,
    planner_table,
    scaling_table,
    schedules_table,
    systems_table,
)
from .vs_torch import gpt2_config, torch_offload_comparison

__all__ = [
    "ABLATION",
    "BASELINE",
    "BASELINE_STATE",
    "BASELINES",
    "Best",
    "HARDWARE",
    "HARDWARE_8",
    "HARMONY_POLICIES",
    "HYDRA_BASELINES",
    "OUT_OF_CORE",
    "PAPER_MODELS",
    "RUNGS",
    "TrainingRun",
    "ablation_ladder",
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
    "grid_claims",
    "hardware_for",
    "heatmap_chart",
    "hydra_chart",
    "hydra_table",
    "karma_chart",
    "karma_table",
    "ladder_chart",
    "ladder_claims",
    "ladder_plans",
    "median_step_s",
    "pack_microbatch_grid",
    "paper_grid",
    "planner_table",
    "scaling_chart",
    "scaling_table",
    "schedules_table",
    "search_time_chart",
    "settings",
    "swap_volume_chart",
    "synthetic_batches",
    "system_bars",
    "systems_chart",
    "systems_table",
    "throughput_chart",
    "torch_offload_chart",
    "torch_offload_comparison",
    "train_side_by_side",
    "training_footprint",
    "versus_baselines",
    "write_outputs",
]
