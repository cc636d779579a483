"""Iteration-based requests: the config Kineto gets, what verification reads from the trace, and
the request/dispatch wire formats (fast; the real-torch proof is test_iterations_torch.py)."""

from __future__ import annotations

import json
import time

import pytest

from gpulens.capture import schemas
from gpulens.capture.agent.verification import Expectation, verify_trace
from gpulens.capture.dynolog import KinetoConfigError, TraceConfig, build_config
from gpulens.capture.models import CaptureRequest, Dispatch

LOG = "/var/tmp/gl/c-1/rank-0.json"


def lines(cfg: TraceConfig) -> dict[str, str]:
    return dict(line.split("=", 1) for line in build_config(cfg).split("\n"))


def test_iteration_config_starts_at_the_roundup_with_a_short_fallback_window():
    kv = lines(TraceConfig(LOG, 30_000, iterations=5, iteration_roundup=100))
    assert kv["PROFILE_START_ITERATION"] == "0"              # always past: Kineto rounds up from now
    assert kv["PROFILE_START_ITERATION_ROUNDUP"] == "100"
    assert kv["ACTIVITIES_ITERATIONS"] == "5" and kv["ACTIVITIES_WARMUP_ITERATIONS"] == "0"
    assert kv["ACTIVITIES_DURATION_MSECS"] == "500"           # the fallback when nothing steps, not 30 s
    plain = lines(TraceConfig(LOG, 2000))
    assert not any(k.startswith(("PROFILE_START_ITERATION", "ACTIVITIES_ITERATIONS")) for k in plain)
    assert plain["ACTIVITIES_DURATION_MSECS"] == "2000"


@pytest.mark.parametrize("over,field", [
    ({"iterations": -1}, "iterations"), ({"iterations": 10_001}, "iterations"), ({"iterations": True}, "iterations"),
    ({"iterations": 5, "iteration_roundup": 0}, "iteration_roundup"),
    ({"iterations": 5, "start_time_ms": int(time.time() * 1000) + 60_000}, "start_time_ms"),
])
def test_bad_iteration_values_are_refused(over, field):
    with pytest.raises(KinetoConfigError) as err:
        build_config(TraceConfig(LOG, 2000, **over))
    assert err.value.field == field


def test_request_and_dispatch_carry_iterations_and_refuse_bad_ones():
    r = CaptureRequest.from_dict({"job_id": "j", "duration_ms": 30_000, "iterations": 8, "iteration_roundup": 200})
    assert (r.iterations, r.iteration_roundup) == (8, 200)
    assert CaptureRequest.from_dict(r.to_dict()) == r
    assert "iterations" not in CaptureRequest(job_id="j").to_dict()
    for bad in ({"iterations": 0}, {"iterations": "5"}, {"iteration_roundup": 0}):
        assert schemas.errors("capture_request", {"job_id": "j", "duration_ms": 1000, **bad})
    d = Dispatch(job_id="j", attempt=0, rank=0, duration_ms=30_000, activities=("cpu_op",), deadline=time.time() + 60,
                 archive_prefix="file:///a/j/0/c-1", iterations=5, iteration_roundup=100)
    assert Dispatch.from_dict(d.to_dict()) == d
    for bad in ({"iterations": 0}, {"iteration_roundup": 0}, {"iterations": 10_001}):
        assert schemas.errors("dispatch", {**d.to_dict(), **bad})


def _trace(path, steps: list[int], optimizer: bool, now: float, span_s: float) -> str:
    events = []
    for i, n in enumerate(steps):
        ts = i * span_s * 1e6 / max(1, len(steps))
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 7, "tid": 7,
                       "ts": ts, "dur": 10.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 7, "ts": ts + 1, "dur": 2.0})
        if optimizer:
            events.append({"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#SGD.step", "pid": 7,
                           "tid": 7, "ts": ts + 5, "dur": 2.0})
    doc = {"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms", "baseTimeNanoseconds": int(now * 1e9),
           "traceEvents": events, "traceName": str(path)}
    path.write_text(json.dumps(doc))
    return str(path)


def test_verification_reads_the_iterations_and_does_not_hold_them_to_the_duration(tmp_path):
    now = time.time()
    exp = dict(activities=("cpu_op", "user_annotation"), window_start=now - 5, window_end=now + 60, duration_ms=500, pid=7)
    path = _trace(tmp_path / "t.json", [1201, 1202, 1203, 1204, 1205], True, now, span_s=20)
    v = verify_trace(path, Expectation(**exp, iterations=5))
    assert v.ok, v.problems
    assert (v.first_step, v.last_step, v.optimizer_steps) == (1201, 1205, 5)
    timed = verify_trace(path, Expectation(**exp))                   # a time request is held to its window
    assert not timed.ok and any("the request was 500 ms" in p for p in timed.problems)
    fallback = verify_trace(_trace(tmp_path / "f.json", [40, 41], False, now, span_s=0.4), Expectation(**exp, iterations=5))
    assert fallback.ok and fallback.optimizer_steps == 0 and fallback.first_step == 40
