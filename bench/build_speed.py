"""Building one plan's task graph, playing it, and simulating it (build, play, summary), with
this code and with an older one, side by side in one process: GPT-2 XL on the
paper's 4-GPU server, the search's best plan at minibatch 64 (harmony-dp x4
uF=4 uB=2 packs F4/B17). ``--before``: a folder holding the older ``harmony``
package (e.g. ``git worktree add /tmp/old <commit>``; its package imports itself
relatively, so it is loaded under another name). The two alternate, round
after round; prints the CPU time of each (median) and after/before.

    python bench/build_speed.py --before /tmp/old [--rounds 31] [--no-gc]
"""

import argparse
import gc
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harmony
from harmony.policies import build_graph
from harmony.simulate import play, simulate_graph


def load_before(folder: str):
    """The older package, copied under the name ``harmony_before``."""
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(Path(folder) / "harmony", tmp / "harmony_before")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("harmony_before")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="folder with the older harmony package")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--no-gc", action="store_true", help="pause the cyclic GC, as the search does")
    args = ap.parse_args()
    old = load_before(args.before)
    spec, hw = harmony.model_spec("gpt2-xl"), harmony.preset("paper-4x1080ti")
    plan = harmony.search(spec, hw, 64, workers=1).iloc[0].plan
    variants = {
        "before": (
            old.model_spec("gpt2-xl"),
            old.preset("paper-4x1080ti"),
            old.Plan.from_dict(plan.to_dict()),
            importlib.import_module("harmony_before.policies").build_graph,
            importlib.import_module("harmony_before.simulate").simulate_graph,
            importlib.import_module("harmony_before.simulate").play,
        ),
        "after": (spec, hw, plan, build_graph, simulate_graph, play),
    }
    if args.no_gc:
        gc.disable()
    steps = ("build", "play", "build+play+summary")
    cpu = {(v, step): [] for v in variants for step in steps}
    for _ in range(args.rounds):
        for v, (s, h, p, build, simulate, play_) in variants.items():
            c0 = time.process_time()
            graph = build(s, h, p)
            c1 = time.process_time()
            play_(graph)
            c2 = time.process_time()
            simulate(build(s, h, p)).summary
            c3 = time.process_time()
            cpu[v, "build"].append(c1 - c0)
            cpu[v, "play"].append(c2 - c1)
            cpu[v, "build+play+summary"].append(c3 - c2)
            del graph
    print(
        f"{plan.describe()}, CPU ms, median of {args.rounds} interleaved rounds, "
        f"GC {'paused' if args.no_gc else 'on'}"
    )
    for step in steps:
        before, after = (1e3 * statistics.median(cpu[v, step]) for v in ("before", "after"))
        print(f"{step}: before {before:.1f}, after {after:.1f}, after/before {after / before:.2f}")


if __name__ == "__main__":
    main()
