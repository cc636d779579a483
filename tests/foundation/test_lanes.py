"""The suite's lanes (tests/lanes.py, issue 42): each lane runs whole on one xdist worker. xdist's own
`loadgroup` silently stopped grouping under pytest 9.2 (it rewrites `item._nodeid`, which 9.2 no
longer reads), spreading the cluster tier over several workers; this runs a real xdist session over
tests of two lanes and reads where each test ran."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

from tests.conftest import REPO
from tests.lanes import LANES, lane_of


def test_every_tier_folder_maps_to_its_lane():
    assert lane_of("tests/cluster/test_1_node.py::test_x") == "cluster"
    assert lane_of("tests/e2e/test_up.py::test_x") == lane_of("tests/container/test_image.py::t") == "images"
    assert lane_of("tests/agent/test_torch.py::t") == lane_of("tests/coordinator/test_soak_real.py::t[b]") == "capture"
    assert lane_of("tests/analysis/test_dask.py::t") == lane_of("tests/foundation/test_lanes.py::t") == "main"
    assert all((REPO / prefix).is_dir() for prefix in LANES), [p for p in LANES if not (REPO / p).is_dir()]


def test_a_lane_runs_whole_on_one_worker_and_lanes_run_on_different_workers(tmp_path):
    files = ["tests/foundation/test_limits.py", "tests/helm/test_doc_names.py", "tests/client/test_cli.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "-v", *files,
                        "--basetemp", str(tmp_path / "bt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    workers = defaultdict(set)
    for m in re.finditer(r"^\[(gw\d+)\] .*?(PASSED|FAILED|SKIPPED) (tests/\S+?)::", r.stdout, re.M):
        workers[lane_of(m.group(3))].add(m.group(1))
    assert set(workers) == {"main", "capture"}, r.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)      # one lane, one worker
    assert workers["main"] != workers["capture"]                           # side by side
