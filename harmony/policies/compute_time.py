"""What a compute task costs, and the least time a plan's compute ops keep their
busiest GPU busy.

The second is a lower bound of the plan's simulated iteration time that needs no
graph: a GPU's compute tasks run one at a time on its compute lane, so the
iteration lasts at least as long as their durations added up. The search skips
candidates that this bound rules out (:func:`harmony.planner.search`).
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..graph import BWD, FWD, FWDBWD, REC
from .base import Op

#: the player ends a task when the clock is within this of its end (harmony.simulate's
#: ``_EPS``), so a lane can run ahead of its tasks' durations by up to this per task;
#: the bound also gives up a relative 1e-9 for the order the durations are added in
_ROUNDING_PER_TASK = 1e-12
_RELATIVE_SLACK = 1e-9


def compute_cost(
    spec: ModelSpec, flops: float, kind: str, s: int, e: int, n: int
) -> tuple[float, float | None]:
    """(seconds, working bytes) of a compute task of layers ``s..e-1`` on ``n``
    samples. REC and BWD split the spec's backward-with-recompute time: REC its
    forward time (at most all of it); BWD's working memory is REC's (None)."""
    if kind == FWD:
        return spec.fwd_time(s, e, n, flops), spec.fwd_work_bytes(s, e, n)
    if kind == FWDBWD:
        return spec.bwd_time(s, e, n, flops), spec.bwd_work_bytes(s, e, n)
    total = spec.bwd_time(s, e, n, flops)
    recompute = min(spec.fwd_time(s, e, n, flops), total)
    return (recompute, spec.bwd_work_bytes(s, e, n)) if kind == REC else (total - recompute, None)


def busiest_gpu_seconds(spec: ModelSpec, hw: Hardware, ops: list[Op]) -> float:
    """The compute seconds of the GPU that computes longest when ``ops`` run in
    this order, as the graph builder times them (a backward op is REC then BWD;
    the hardware's fixed cost per task, or per weight group on the task that
    opens it), less the slack for the simulator's rounding: at most the
    iteration time the simulator gives the plan these ops come from."""
    busy: dict[int, float] = {}
    tasks: dict[int, int] = {}
    group_on: dict[int, tuple] = {}
    costs: dict[tuple, float] = {}
    per_task, overhead = hw.overhead_per == "task", hw.task_overhead_s
    for op in ops:
        g, (s, e) = op.gpu, op.layers
        n = op.samples[1] - op.samples[0]
        opens_group = group_on.get(g) != op.group
        group_on[g] = op.group
        for i, kind in enumerate((REC, BWD) if op.kind == BWD else (op.kind,)):
            key = (kind, s, e, n)
            seconds = costs.get(key)
            if seconds is None:
                seconds = costs[key] = compute_cost(spec, hw.gpu_flops, kind, s, e, n)[0]
            if per_task or (opens_group and i == 0):
                seconds += overhead
            busy[g] = busy.get(g, 0.0) + seconds
            tasks[g] = tasks.get(g, 0) + 1
    if not busy:
        return 0.0
    return max(busy[g] * (1 - _RELATIVE_SLACK) - _ROUNDING_PER_TASK * (tasks[g] + 1) for g in busy)
