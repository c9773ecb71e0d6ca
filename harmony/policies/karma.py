"""KARMA (Wahib et al., SC 2020): out-of-core training that mixes swapping with recompute.

The published system trains models larger than GPU memory one minibatch at a
time per GPU: layers and their activations are swapped between host and GPU
memory with prefetching, and for each block of layers a performance model
decides whether the block's activations are swapped out to host memory and
back for backward, or dropped and recomputed, so that swapping hides behind
compute. Across nodes it is data parallel, with the gradient exchange
pipelined layer by layer with backward and the weight update on the host
CPU. It reports 1.52x on average over earlier out-of-core methods.

This policy reproduces, in harmony's terms: each microbatch goes through the
whole model on its own (no input-batch grouping): every pack's weights are
swapped in for its forward and again for its backward, with the next pack
prefetched (double buffering); the swap-or-recompute choice is the set of
backward-pack boundaries: a layer that starts a pack has its input swapped
out in forward and back before recompute ("swap"), a layer inside a pack has
its input rebuilt from the pack's first input ("recompute").
:func:`~harmony.planner.systems.choose_karma` picks those boundaries with
the performance model of :func:`~harmony.planner.karma.model_packs`, and the
largest microbatch that fits (KARMA trains the batch it is given, out of
core). The optimizer state and the update are on the host;
over several GPUs each one takes its share of the minibatch, every
microbatch's gradient goes to host memory where the GPUs' gradients add up,
and a pack's update starts as soon as all of its gradients are in, while
backward goes on (across servers, the engine's distributed mode all-reduces
each pack's gradient as it is done, as KARMA's phased exchange does).

Simplified: harmony's recompute always rebuilds a whole pack from its first
input, so a "swapped" layer is recomputed too (KARMA swaps every activation
of such a layer) and the choice is made at layer boundaries only; the
performance model is the simple one of
:func:`~harmony.planner.karma.model_packs`, not KARMA's: as the IR recomputes
every layer anyway, a recompute costs it nothing and a swap costs bytes, so it
swaps the fewest, cheapest boundaries that memory allows; the
schedule is the one of :mod:`.harmony_no_grouping`, KARMA's difference being
which packs it runs. Recompute overlaps the arrival of the output gradient
(``overlap_recompute``), as KARMA schedules recompute concurrently with the
transfers it hides.
"""

from __future__ import annotations

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..graph import TaskGraph
from ..plan import Plan
from . import harmony_no_grouping

NAME = "karma"
#: what it is to the workbench: "harmony" (Harmony's own placements), "ablation" (Harmony
#: without one of its techniques) or "system" (another published system)
ROLE = "system"
#: planned by harmony's search (else by its own chooser in harmony.planner.systems)
SEARCHED = False
PER_MICROBATCH = True
#: the bytes of the per-microbatch schedule
swap_volume = harmony_no_grouping.swap_volume


def build(spec: ModelSpec, hw: Hardware, plan: Plan, model: int = 0) -> TaskGraph:
    """The per-microbatch schedule of :mod:`.harmony_no_grouping` on KARMA's packs."""
    graph = harmony_no_grouping.build(spec, hw, plan, model)
    graph.info["policy"] = NAME
    return graph
