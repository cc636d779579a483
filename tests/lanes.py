"""Test lanes: the suite as four pytest-xdist workers side by side, one lane each (issue 42).

Most of the suite's time is spent waiting (Kubernetes and the image being built, pods, Prometheus
windows, Kineto's polls, `gpulens up` demos), one test at a time, on a machine whose two cores sat
half idle. Every test belongs to one lane by its folder, and each lane runs whole on one worker, in
collection order, one test at a time (`LaneScheduling`: xdist's scope scheduler with the lane as the
scope, so a lane is one unit of work and is never split), so what runs side by side is one test of
each lane:

  cluster   tests/cluster: builds Kubernetes the first time, then waits on a real cluster
  images    tests/container and tests/e2e: builds the image, runs components in containers and
            `gpulens up` end to end
  capture   tests/agent, coordinator, gateway, client, up: real Kineto in torch trainers, the soak
  main      everything else (analysis, exporter, operator, foundation, helm, alert rules, ...)

(xdist's own `--dist loadgroup` cannot do this with pytest 9.2: it marks groups by rewriting
`item._nodeid`, which pytest 9.2 no longer reads, so every test became its own unit and the
cluster's package fixture came up in several workers at once.)

The lanes already keep their state apart (each test its own ports, tmp folders, socket folders and
network-namespace names; the cluster's names, mounts and cgroups are its own and checked as such by
tests/cluster/harness.machine_state), and each lane's session fixtures live in its own worker.
`scripts/test.sh` runs `-n 4` (the default, and CI's); `GPULENS_TEST_LANES=0` runs one process
(`-p no:xdist`: the lanes do nothing but time themselves). At the end the terminal summary gives each lane's test count,
the time spent in its tests and when it ran, just above pytest's closing line."""

from __future__ import annotations

import time

import pytest

#: folder prefix (relative to the repository) -> lane; anything else is "main"
LANES = {"tests/cluster/": "cluster", "tests/container/": "images", "tests/e2e/": "images",
         **{f"tests/{d}/": "capture" for d in ("agent", "coordinator", "gateway", "client", "up")}}
KEY = "gpulens_lanes"


def lane_of(nodeid: str) -> str:
    return next((lane for prefix, lane in LANES.items() if nodeid.startswith(prefix)), "main")


class LaneClock:
    """Per lane: when its first test started, when its last one ended, how many ran (this process)."""

    def __init__(self) -> None:
        self.lanes: dict[str, dict] = {}

    def started(self, nodeid: str) -> None:
        lane = self.lanes.setdefault(lane_of(nodeid), {"start": time.time(), "end": time.time(), "tests": 0, "busy": 0.0})
        lane["began"] = time.time()

    def finished(self, nodeid: str) -> None:
        lane = self.lanes[lane_of(nodeid)]
        lane["end"], lane["tests"] = time.time(), lane["tests"] + 1
        lane["busy"] += lane["end"] - lane.pop("began", lane["end"])

    def merge(self, other: dict) -> None:
        for name, lane in other.items():
            mine = self.lanes.setdefault(name, dict(lane, tests=0, busy=0.0))
            mine["start"], mine["end"] = min(mine["start"], lane["start"]), max(mine["end"], lane["end"])
            mine["tests"] += lane["tests"]
            mine["busy"] += lane["busy"]


def pytest_configure(config) -> None:
    config.pluginmanager.register(LaneClock(), "gpulens-lane-clock")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler, the scope being the lane: one lane, one worker, collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return LaneScheduling(config, log)


def _clock(config) -> LaneClock:
    return config.pluginmanager.get_plugin("gpulens-lane-clock")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _clock(item.config).started(item.nodeid)
    yield
    _clock(item.config).finished(item.nodeid)


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workeroutput"):          # an xdist worker: hand the clock to the controller
        session.config.workeroutput[KEY] = _clock(session.config).lanes


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _clock(node.config).merge(getattr(node, "workeroutput", {}).get(KEY, {}))


def pytest_terminal_summary(terminalreporter, config) -> None:
    if hasattr(config, "workeroutput"):
        return
    lanes = _clock(config).lanes
    if not lanes:
        return
    first = min(lane["start"] for lane in lanes.values())
    terminalreporter.section("lanes: time in each lane's tests, and when it ran (from the first test)")
    for name, lane in sorted(lanes.items(), key=lambda kv: kv[1]["start"]):
        terminalreporter.write_line(
            f"lane {name:8} {lane['tests']:5d} tests  {lane['busy']:7.0f} s in its tests  "
            f"(from +{lane['start'] - first:.0f} s to +{lane['end'] - first:.0f} s)")
