"""One colour per task kind and per policy, for every chart of the project.

Task kinds are those of :mod:`harmony.graph`, each with a colour and a few
words saying what it does. Policies get their colour from their ``ROLE`` in
:mod:`harmony.policies` (Harmony's own placements in blues, ablations of
Harmony in oranges, other systems in greens, purples and browns), in the
order of :func:`harmony.policies.names`, so a policy added there gets a
colour of its family without being listed here.

Plain data (hex strings, ``{"domain", "range"}`` dicts): no altair needed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from .. import graph as g
from ..policies import POLICIES, names

#: task kind -> (colour, what it is in words). Compute warm, host link cool, GPU<->GPU green,
#: disk greys.
KINDS: dict[str, tuple[str, str]] = {
    g.FWD: ("#f58518", "forward of a pack, all its microbatches"),
    g.REC: ("#ff9da6", "recompute a pack's forward from its stashed input"),
    g.BWD: ("#e45756", "backward of a pack"),
    g.FWDBWD: ("#b279a2", "last pack: forward + loss + backward"),
    g.UPD: ("#9d755d", "optimizer step of a pack, on the CPU"),
    g.W_IN: ("#4c78a8", "weights host → GPU"),
    g.G_OUT: ("#72b7b2", "gradients GPU → host"),
    g.STASH_OUT: ("#54a24b", "stashed pack input GPU → host"),
    g.STASH_IN: ("#88d27a", "stashed input host → GPU"),
    g.ACT_OUT: ("#bab0ac", "activations GPU → host"),
    g.ACT_IN: ("#8c8c8c", "activations host → GPU"),
    g.DATA_IN: ("#eeca3b", "inputs and labels host → GPU"),
    g.P2P: ("#2ca02c", "activations GPU → GPU"),
    g.REDUCE: ("#17becf", "gradient reduce between GPUs"),
    g.G_IN: ("#9ecae9", "gradient accumulator host → GPU"),
    g.OPT_IN: ("#8c6bb1", "weights, gradients, optimizer state host → GPU"),
    g.OPT_OUT: ("#c7b3e5", "updated weights and optimizer state GPU → host"),
    g.DISK_IN: ("#636363", "optimizer state or weights disk → host"),
    g.DISK_OUT: ("#bdbdbd", "updated optimizer state or weights host → disk"),
}
KIND_COLORS = {kind: color for kind, (color, _) in KINDS.items()}
KIND_WORDS = {kind: words for kind, (_, words) in KINDS.items()}

#: policy role -> colours handed out in policy order; roles not listed use OTHER
ROLE_COLORS: dict[str, tuple[str, ...]] = {
    "harmony": ("#1f4e9c", "#6b9bd8", "#0b2e66"),
    "ablation": ("#e8702a", "#f4a259", "#b34a00"),
    "system": ("#59a14f", "#b07aa1", "#9c755f", "#d4a017", "#76b7b2", "#ff9da7", "#8f6d9e"),
}
OTHER = ("#7f7f7f", "#bcbd22", "#17becf", "#d62728", "#aec7e8", "#c49c94")
#: series that are not policies but recur across charts; None: the first Harmony policy's colour
SERIES_COLORS: dict[str, str | None] = {
    "plain PyTorch loop": "#3a3a3a",
    "PyTorch offload": "#7f7f7f",
    "harmony.Engine": None,
}
#: bars of plans that do not fit in GPU memory
NO_FIT = "#c8c8c8"


def kind_color(kind: str) -> str:
    """The colour of a task kind (grey for a kind this palette does not know)."""
    return KIND_COLORS.get(kind, OTHER[0])


def policy_colors() -> dict[str, str]:
    """Every policy of :mod:`harmony.policies` -> its colour."""
    taken: dict[str, int] = {}
    out = {}
    for name in names():
        role = getattr(POLICIES[name], "ROLE", None)
        colors = ROLE_COLORS.get(role, OTHER)
        i = taken.get(role, 0)
        taken[role] = i + 1
        out[name] = colors[i % len(colors)]
    return out


def color(label: str) -> str:
    """The colour of a series: a policy's, a known series', else one picked by
    the label's checksum (the same label gets the same colour in every chart)."""
    policies = policy_colors()
    if label in policies:
        return policies[label]
    if label in SERIES_COLORS:
        return SERIES_COLORS[label] or policies[names("harmony")[0]]
    return OTHER[zlib.crc32(label.encode()) % len(OTHER)]


def kind_scale(kinds: Iterable[str]) -> dict[str, list[str]]:
    """``{"domain", "range"}`` for the kinds present, in this palette's order."""
    present = set(kinds)
    domain = [k for k in KINDS if k in present] + sorted(present - set(KINDS))
    return {"domain": domain, "range": [kind_color(k) for k in domain]}


def series_scale(labels: Iterable[str]) -> dict[str, list[str]]:
    """``{"domain", "range"}`` for series labels: policies first, in policy order."""
    present = list(dict.fromkeys(labels))
    order = {name: i for i, name in enumerate(names())}
    domain = sorted(present, key=lambda s: (order.get(s, len(order)), present.index(s)))
    return {"domain": domain, "range": [color(s) for s in domain]}
