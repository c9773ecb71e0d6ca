"""A problem in the explorer's words: what to change with its own controls (host
memory, disk, GPUs, layers per pack), where the planner's message names a command
line flag or an API call."""

from __future__ import annotations

import re

#: (the planner's advice, the explorer's): each pattern ends a message or a clause of one
_CONTROLS = (
    (
        r": give the server a disk tier \(--disk [^)]*\) or more host memory \(--host-memory\)$",
        ": raise host memory or pick a disk in the controls above",
    ),
    (
        r": run without gpu_optimizer \(the CPU update can read its state from a disk tier\) "
        r"or more host memory \(--host-memory\)$",
        ": raise host memory in the controls above (this system updates on the GPUs, "
        "so its state does not go to a disk)",
    ),
    (
        r": give more host memory \(--host-memory, Hardware\.with_host_memory\), or smaller "
        r"backward packs \(less to stage\) or fewer stashes$",
        ": raise host memory, or lower layers per pack (less to stage), in the controls above",
    ),
    (
        r"; train several models side by side with harmony\.train_many, or one model on "
        r"several GPUs with ",
        "; set GPUs to 1 in the controls above, or pick ",
    ),
    (r"\bhost_memory is\b", "host memory is"),
)


def in_controls_words(problem: str | None) -> str | None:
    """``problem`` (None: none) with the planner's advice said with the controls."""
    if problem is None:
        return None
    for pattern, words in _CONTROLS:
        problem = re.sub(pattern, words, problem)
    return problem
