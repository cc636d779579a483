"""The Kineto config builder refuses what Kineto would mangle or silently drop."""

from __future__ import annotations

import time

import pytest

from gpulens.capture.dynolog import (KinetoConfigError, TraceConfig, build_config, kineto_trace_path, log_file_for,
                                     tick_aligned_start_ms)
from gpulens.capture.models import CaptureOptions


def parse(text: str) -> dict[str, str]:
    """Kineto's rule: one KEY=VALUE per line, exactly two parts."""
    out = {}
    for line in text.split("\n"):
        parts = line.split("=")
        assert len(parts) == 2, f"Kineto would reject {line!r}"
        out[parts[0]] = parts[1]
    return out


def test_config_lines_are_what_kineto_reads():
    text = build_config(TraceConfig("/traces/c-1/rank-0.json", 750, ("cpu_op", "python_function"),
                                    CaptureOptions(with_stack=True, record_shapes=True)))
    cfg = parse(text)
    assert cfg["ACTIVITIES_LOG_FILE"] == "/traces/c-1/rank-0.json"
    assert cfg["ACTIVITY_TYPES"] == "cpu_op,python_function"  # singular key; ACTIVITIES_TYPES is silently ignored
    assert "ACTIVITIES_TYPES" not in cfg
    assert cfg["ACTIVITIES_DURATION_MSECS"] == "750"
    assert cfg["PROFILE_START_TIME"] == "0"  # 0 = now + Kineto's warm-up
    assert cfg["PROFILE_WITH_STACK"] == "true" and cfg["PROFILE_REPORT_INPUT_SHAPES"] == "true"
    assert cfg["PROFILE_WITH_FLOPS"] == "false"
    # memory events in the JSON trace, never PROFILE_MEMORY (pickle snapshot instead of a trace)
    assert "PROFILE_MEMORY" not in cfg
    assert "REQUEST_TRACE_ID" not in cfg
    assert not text.endswith("\n")


def test_log_file_is_unique_per_capture_and_target():
    a = log_file_for("/t", "c-20260101t000000-aaaa", "rank-0")
    b = log_file_for("/t", "c-20260101t000000-bbbb", "rank-0")
    c = log_file_for("/t", "c-20260101t000000-aaaa", "rank-1")
    assert len({a, b, c}) == 3
    assert kineto_trace_path(a, 37) == "/t/c-20260101t000000-aaaa/rank-0_37.json"
    assert kineto_trace_path("/t/x.pt.trace.json", 5) == "/t/x_5.pt.trace.json"
    for bad in ("", "..", "a/b", "x.json"):
        with pytest.raises(KinetoConfigError):
            log_file_for("/t", "c-1", bad)


@pytest.mark.parametrize("path", ["/tr=aces/a.json", "/traces/a#b.json", "/traces/../etc/a.json",
                                  "/traces/a.json\nACTIVITY_TYPES=kernel", " /traces/a.json", "traces/a.json",
                                  "/traces/no-json-suffix"])
def test_log_file_values_kineto_cannot_carry_are_refused(path):
    with pytest.raises(KinetoConfigError) as err:
        build_config(TraceConfig(path, 500))
    assert err.value.field == "log_file"


@pytest.mark.parametrize("activities", [("cpu_op", "cuda_sync"), ("CPU_OP_TYPO",), ("hardware_counters",), ()])
def test_unknown_or_missing_activity_names_are_refused(activities):
    with pytest.raises(KinetoConfigError) as err:
        build_config(TraceConfig("/t/a.json", 500, activities))
    assert err.value.field == "activities"


def test_newer_names_only_when_the_kineto_version_is_known():
    text = build_config(TraceConfig("/t/a.json", 500, ("cpu_op", "cuda_sync"), allow_newer_activities=True))
    assert parse(text)["ACTIVITY_TYPES"] == "cpu_op,cuda_sync"


@pytest.mark.parametrize("duration", [0, -5, 600_001, 1.5, True])
def test_bad_durations_are_refused(duration):
    with pytest.raises(KinetoConfigError) as err:
        build_config(TraceConfig("/t/a.json", duration))
    assert err.value.field == "duration_ms"


def test_explicit_start_time_must_leave_room_for_poll_and_warmup():
    now = time.time()
    with pytest.raises(KinetoConfigError) as err:
        build_config(TraceConfig("/t/a.json", 500, start_time_ms=int((now + 10) * 1000)), now=now)
    assert err.value.field == "start_time_ms"
    ok = build_config(TraceConfig("/t/a.json", 500, start_time_ms=int((now + 20) * 1000)), now=now)
    assert parse(ok)["PROFILE_START_TIME"] == str(int((now + 20) * 1000))


def test_trace_id_must_be_decimal():
    assert parse(build_config(TraceConfig("/t/a.json", 500, trace_id="123")))["REQUEST_TRACE_ID"] == "123"
    with pytest.raises(KinetoConfigError):
        build_config(TraceConfig("/t/a.json", 500, trace_id="12=3"))


@pytest.mark.parametrize("earliest, expected", [
    (1796626560.0, 1796626560_000),        # already on a whole second: kept
    (1796626560.001, 1796626561_000),      # a millisecond past: the next one, never earlier
    (1796626560.9999, 1796626561_000),
    (1796626575.5, 1796626576_000),
])
def test_start_instants_fall_on_whole_seconds_never_before_the_earliest(earliest, expected):
    """Kineto's profiler tick keeps the phase of the last instant it slept until; a start on that
    phase gives the capture a whole tick of room (tests/agent/test_tick_grid_torch.py)."""
    got = tick_aligned_start_ms(earliest)
    assert got == expected and got % 1000 == 0 and got >= earliest * 1000


@pytest.mark.parametrize("earliest, phase, expected", [
    (1796626575.5, 500, 1796626575_500), (1796626575.5004, 500, 1796626576_500), (1796626575.6, 500, 1796626576_500),
    (1796626575.4, 500, 1796626575_500), (1796626575.4, 1500, 1796626575_500), (1796626575.0, 999, 1796626575_999),
])
def test_start_instants_on_another_phase(earliest, phase, expected):
    got = tick_aligned_start_ms(earliest, phase)
    assert got == expected and got >= earliest * 1000 and got - earliest * 1000 < 1000
