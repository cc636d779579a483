"""The soak's reading of a failed target (tests/coordinator/soak.py): a trace_timeout is excused
only by the trainer's own line that Kineto cancelled that very config, same pid, between queueing
and the deadline; anything else stays unexplained and fails the soak."""

from __future__ import annotations

from pathlib import Path

from tests.coordinator.soak import CaptureResult, Soak, SoakNode

DETAIL = ("queued at 14:55:07Z, but no /var/tmp/gl-soak-x/node-2/traces/c-20261205t145507-9aa0fa51/rank-2_14385.json "
          "by the deadline 14:55:37Z; dynolog still answers")
CANCEL = ("ERROR:2026-12-05 14:55:{s} {pid}:14411 GenericActivityProfiler.cpp:68] Not starting tracing - "
          "insufficient time for warmup. Time to warmup (ms): 4999")


def _soak(tmp_path: Path, trainer_log: str) -> Soak:
    node = object.__new__(SoakNode)               # its folders and processes are not needed to read
    node.name, node.base, node.archive, node.dynolog = "node-2", tmp_path, tmp_path / "archive", None
    log = tmp_path / "trainer-2.log"
    log.write_text(f"ready 14385 rank 2\n{trainer_log}\n")
    node.logs = [log]
    soak = object.__new__(Soak)
    soak.nodes, soak.kineto_cancellations = [node], []
    return soak


def _timed_out() -> list[CaptureResult]:
    return [CaptureResult("c-20261205t145507-9aa0fa51", "window", 30.0, "converged",
                          {"rank-2": {"state": "failed", "reason": "trace_timeout", "detail": DETAIL, "iterations": None},
                           "rank-3": {"state": "archived", "reason": None, "detail": None, "iterations": None}})]


def test_kinetos_own_cancellation_of_that_config_excuses_the_timeout(tmp_path):
    soak = _soak(tmp_path, CANCEL.format(s="09", pid=14385))
    assert soak.explain(_timed_out()) == []
    assert len(soak.kineto_cancellations) == 1 and "insufficient time for warmup" in soak.kineto_cancellations[0]


def test_another_pid_or_another_time_explains_nothing(tmp_path):
    for line in (CANCEL.format(s="09", pid=14386), CANCEL.format(s="01", pid=14385), "", "Not starting tracing"):
        soak = _soak(tmp_path, line)
        (unexplained,) = soak.explain(_timed_out())
        assert "rank-2: trace_timeout" in unexplained and "trainer-2.log" in unexplained
        assert soak.kineto_cancellations == []
