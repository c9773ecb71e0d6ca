"""The pack explorer's chart: altair (``PackExplorer.chart(r).to_dict()``) against
the spec built directly (``live_spec.exploration_spec(r)``), which the live view
shows; the two specs are the same (``tests/test_explorer_updates.py``).

For each setting the explorer computes once (its plans simulated), then the two
ways of building the chart run alternately, ``--repeat`` times each; printed:
the median seconds of each and their ratio. A benchmark, not a test. Run from
the repository root::

    python bench/explorer_chart.py --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: setting -> the explorer's controls (the rest its defaults: BERT-96 on the paper's server)
SETTINGS = {
    "default (bert-96, 4 GPUs)": {},
    "bwd microbatch 4, 3 layers per pack": {"bwd_microbatch": 4, "pack_size": 3},
    "layer-swap chosen": {"policy": "layer-swap"},
    "gpt2-xl, state on an NVMe disk": {"model": "gpt2-xl", "disk": "nvme", "host_memory": "75%"},
    "bert-large on 1 GPU": {"model": "bert-large", "n_gpus": 1, "minibatch": 8},
}


def seconds(build) -> float:
    t0 = time.perf_counter()
    build()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from harmony.workbench.live_spec import exploration_spec
    from harmony.workbench.widgets import PackExplorer

    print(f"{'setting':40s} {'altair s':>9s} {'direct s':>9s} {'ratio':>7s}")
    for name, controls in SETTINGS.items():
        ex = PackExplorer(**controls)
        r = ex.compute()
        altair, direct = [], []
        for _ in range(args.repeat):
            altair.append(seconds(lambda: ex.chart(r).to_dict(validate=False)))
            direct.append(seconds(lambda: exploration_spec(r)))
        a, d = statistics.median(altair), statistics.median(direct)
        print(f"{name:40s} {a:9.3f} {d:9.3f} {a / d:7.1f}")


if __name__ == "__main__":
    main()
