"""Whether the simulator and the search give exactly what they gave before a
change to them: run it with ``--save`` on the code before, with ``--check`` on
the code after.

It plays GPT-2 XL graphs of every policy on the Harmony paper's 4-GPU server
(each other system's own plan, and the first, middle and last plans of each
policy in the search's ranking) and of Harmony's policies on the same server short of host
memory over an NVMe disk tier, and keeps every task's start and end, the peaks,
the memory timelines and the memory order, the trace's summary and rows; and the
search's DataFrames (every column, and ``attrs`` but the search time) of a few
searches. ``--check`` compares all of it exactly (NaN equal to NaN) and says
what differs.

    python bench/sim_identity.py --save before.pkl
    python bench/sim_identity.py --check before.pkl
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys

import harmony
from harmony.errors import OutOfMemoryError
from harmony.planner import CHOOSERS, plans_for
from harmony.policies import build_graph
from harmony.simulate import play, simulate_graph

MINIBATCH = 64


def servers() -> dict[str, harmony.Hardware]:
    paper = harmony.preset("paper-4x1080ti")
    return {"paper": paper, "disk": paper.with_host_memory("24GiB").with_disk("nvme")}


def searches(spec) -> dict[str, object]:
    """The searches whose DataFrames are compared, by name."""
    hw = servers()
    small = harmony.model_spec("gpt2-medium")
    return {
        "gpt2-xl paper": harmony.search(spec, hw["paper"], MINIBATCH),
        "gpt2-xl disk": harmony.search(
            spec, hw["disk"], MINIBATCH, policies=["harmony-pp", "harmony-dp"]
        ),
        "gpt2-medium 1-2 gpus": harmony.search(small, hw["paper"], 32, n_gpus=[1, 2], top_k=1),
    }


def plans(spec, found: dict) -> list[tuple[str, str, harmony.Plan]]:
    """(server, label, plan) of every graph whose play is compared."""
    out = []
    for policy in CHOOSERS:
        try:
            (plan,) = plans_for([policy], spec, servers()["paper"], MINIBATCH).values()
        except OutOfMemoryError:  # no plan of this system fits
            continue
        out.append(("paper", f"{policy} own", plan))
    for name, server in (("gpt2-xl paper", "paper"), ("gpt2-xl disk", "disk")):
        for policy, rows in found[name].groupby("policy"):
            for i in sorted({0, len(rows) // 2, len(rows) - 1}):
                out.append((server, f"{policy} rank {i}", rows.iloc[i].plan))
    return out


def record() -> dict:
    spec = harmony.model_spec("gpt2-xl")
    found = searches(spec)
    out: dict = {"search": {}, "play": {}}
    for name, df in found.items():
        attrs = {k: v for k, v in df.attrs.items() if k != "search_s"}
        out["search"][name] = (df.to_dict("list"), attrs)
    hw = servers()
    for server, label, plan in plans(spec, found):
        graph = build_graph(spec, hw[server], plan)
        p = play(graph)
        trace = simulate_graph(build_graph(spec, hw[server], plan))
        out["play"][f"{server}: {label}: {plan.describe()}"] = {
            "start": p.start,
            "end": p.end,
            "peak": p.peak,
            "memory": p.memory,
            "order": p.order,
            "summary": trace.summary,
            "trace memory": trace.memory,
            "rows": trace.rows,
        }
    return out


def same(a, b) -> bool:
    """Equal, NaN equal to NaN, through lists, tuples and dicts."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def differences(before: dict, after: dict) -> list[str]:
    out = []
    for part in ("search", "play"):
        if list(before[part]) != list(after[part]):
            out.append(f"{part}: different cases: {list(before[part])} vs {list(after[part])}")
            continue
        for case, was in before[part].items():
            now = after[part][case]
            if isinstance(was, dict):
                out += [f"{case}: {k} differs" for k in was if not same(was[k], now[k])]
            elif not same(was, now):
                out.append(f"{case}: differs")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", help="write what the code gives now to this file")
    group.add_argument("--check", help="compare what the code gives now with this file")
    args = ap.parse_args()
    now = record()
    n_play, n_search = len(now["play"]), len(now["search"])
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(now, f)
        print(f"saved {n_play} plays and {n_search} searches to {args.save}")
        return
    with open(args.check, "rb") as f:
        before = pickle.load(f)
    diff = differences(before, now)
    print("\n".join(diff) or f"identical: {n_play} plays and {n_search} searches")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
