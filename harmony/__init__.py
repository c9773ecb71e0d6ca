"""harmony: train deep networks larger than GPU memory.

One task-graph IR, many policies, two executors: a ModelSpec (per-layer
costs) and a Hardware description go through a policy and a Plan into a
TaskGraph, which :func:`simulate` plays (and the engine runs for real),
giving a Trace. :func:`search` picks the plan.
"""

from .costs import zoo
from .costs.catalog import known_models, model_spec
from .costs.hardware import PRESETS, Hardware, parse_bytes, parse_rate, preset
from .costs.spec import Curve, LayerCost, ModelSpec
from .engine import (
    Chain,
    EmulatedDevice,
    EmulatedServer,
    Engine,
    decompose,
    empty_weights,
    materialize,
    reference_step,
)
from .engine.checkpoint import CheckpointDir, CheckpointError
from .engine.optim import FlatAdamW
from .engine.profiler import profile
from .engine.train_many import train_many
from .errors import DeadlockError, HarmonyError, NonFiniteError, OutOfMemoryError
from .graph import Task, TaskGraph
from .plan import Plan
from .planner import plan_for, search, simulate
from .planner.multi_model import Job, compare_schedules, simulate_many
from .policies import POLICIES, build_graph, swap_volume
from .simulate import simulate_graph
from .trace import Trace

__version__ = "0.1.0"

__all__ = [
    "Chain",
    "EmulatedDevice",
    "EmulatedServer",
    "Engine",
    "decompose",
    "empty_weights",
    "materialize",
    "reference_step",
    "CheckpointDir",
    "CheckpointError",
    "Curve",
    "DeadlockError",
    "FlatAdamW",
    "Hardware",
    "HarmonyError",
    "LayerCost",
    "ModelSpec",
    "NonFiniteError",
    "OutOfMemoryError",
    "POLICIES",
    "PRESETS",
    "Plan",
    "Task",
    "TaskGraph",
    "Trace",
    "build_graph",
    "known_models",
    "profile",
    "model_spec",
    "parse_bytes",
    "parse_rate",
    "preset",
    "plan_for",
    "search",
    "simulate",
    "simulate_graph",
    "swap_volume",
    "Job",
    "compare_schedules",
    "simulate_many",
    "train_many",
    "zoo",
]
