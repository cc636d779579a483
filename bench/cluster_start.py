"""Warm start of the test cluster: `scripts/cluster.sh down` then `up` (binaries cached), N runs,
median wall time until the node is Ready and the default ServiceAccount exists; and `down`'s time.
The cold path (compiling Kubernetes) prints its own per-binary times from cluster/build.sh; run it
with an empty cache: GPULENS_CLUSTER_CACHE=/tmp/empty python bench/cluster_start.py --runs 1.
`--nodes 2` times the two-node cluster (issue 33). Root only; leaves the cluster down."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster.sh"


def timed(*args: str) -> float:
    t0 = time.monotonic()
    subprocess.run(["bash", str(SCRIPT), *args], check=True, capture_output=True, timeout=3600)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=1)
    a = ap.parse_args()
    timed("down")
    ups, downs = [], []
    for i in range(a.runs):
        ups.append(timed("up", "--nodes", str(a.nodes)))
        downs.append(timed("down"))
        print(f"run {i + 1}: up {ups[-1]:.1f} s, down {downs[-1]:.1f} s", flush=True)
    print(f"median ({a.nodes} node(s)): up {statistics.median(ups):.1f} s, down {statistics.median(downs):.1f} s")


if __name__ == "__main__":
    main()
