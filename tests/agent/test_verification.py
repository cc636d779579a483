"""Streaming trace reading and verification: same answers as json.load, and every check bites."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import time
from pathlib import Path

import pytest

from capture.agent.jsonstream import TraceStream, TraceSyntaxError
from capture.agent.verification import Expectation, verify_trace
from tests.agent.conftest import kineto_like_trace


def stream_as_dict(data: bytes, chunk: int) -> dict:
    out, events = {}, []
    for kind, item in TraceStream(io.BytesIO(data), chunk=chunk):
        if kind == "event":
            events.append(item)
        else:
            name, value = item
            out[name] = events if name == "traceEvents" else value
    return out


TRICKY = json.dumps({
    "schemaVersion": 1, "deviceProperties": [{"name": "gpu \u00e9\u6f22", "n": [1, 2.5e-3, -0.0]}],
    "traceEvents": [{"name": "a\"b\\c\u2603", "ts": 123456789012.125, "dur": 1e3, "args": {"x": None, "y": True}},
                    {"name": "x", "ts": 1}, [], 7, "s", {"nested": {"deep": [{"a": [1, [2, [3]]]}]}}],
    "empty": {}, "z": 12345678901234567890, "traceName": "t.json"}, ensure_ascii=False).encode()


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_stream_equals_json_load_at_every_chunk_size(chunk):
    assert stream_as_dict(TRICKY, chunk) == json.loads(TRICKY)


def test_stream_equals_json_load_on_real_kineto_traces(shared_traces):
    for gz in sorted(shared_traces.glob("*/*.json.gz")):
        data = gzip.decompress(gz.read_bytes())
        assert stream_as_dict(data, 4096) == json.loads(data), gz.name


def test_every_truncation_is_an_error():
    for cut in range(0, len(TRICKY) - 1):
        with pytest.raises(TraceSyntaxError):
            stream_as_dict(TRICKY[:cut], 16)


@pytest.mark.parametrize("bad", [b"", b"[]", b'{"a": 1} {}', b'{"a": 1,}', b'{"traceEvents": [1 2]}',
                                 b'{"a": \xff}', b'{"traceEvents": [{"ts": 1},]}', b"{1: 2}"])
def test_malformed_input_is_an_error(bad):
    with pytest.raises(TraceSyntaxError):
        stream_as_dict(bad, 5)


# --- verification ------------------------------------------------------------------------------

PID = 4242


def expect(start: float, **over) -> Expectation:
    kw = dict(activities=("cpu_op",), window_start=start - 5, window_end=start + 30, duration_ms=500, pid=PID)
    kw.update(over)
    return Expectation(**kw)


@pytest.fixture
def now() -> float:
    return time.time()


def test_a_good_trace_verifies_with_its_checksum(tmp_path, now):
    path = kineto_like_trace(tmp_path / "rank-0_4242.json", pid=PID, start=now, trace_id="77")
    v = verify_trace(str(path), expect(now, trace_id="77"))
    assert v.ok, v.problems
    assert v.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and v.size == path.stat().st_size
    assert v.categories == {"cpu_op": 20} and v.trace_id == "77" and v.event_count == 22
    assert now - 1 < v.first_event_at < now + 1


def test_an_unrequested_python_function_fails_verification(tmp_path, now):
    """The negative assertion: Kineto's default set includes python_function, so only its absence
    shows that ACTIVITY_TYPES=cpu_op was honoured."""
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now, cats=("cpu_op", "python_function"))
    v = verify_trace(str(path), expect(now))
    assert not v.ok
    assert any("not requested are present: python_function (20 events)" in p for p in v.problems)
    assert verify_trace(str(path), expect(now, activities=("cpu_op", "python_function"), with_stack=True)).ok


def test_requested_types_the_process_must_produce_are_required(tmp_path, now):
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now, cats=("cpu_op",))
    v = verify_trace(str(path), expect(now, activities=("cpu_op", "python_function"), with_stack=True))
    assert not v.ok and any("absent: python_function" in p for p in v.problems)
    # without stacks python_function is not expected, and user annotations never are
    assert verify_trace(str(path), expect(now, activities=("cpu_op", "python_function", "user_annotation"))).ok


@pytest.mark.parametrize("case, over, needle", [
    ("early", dict(window_start_shift=+20), "before the capture window"),
    ("late", dict(window_end_shift=-29.8), "after the capture window"),
    ("long", dict(duration_ms=100, span_slack_ms=100), "events span"),
    ("id", dict(trace_id="other"), "trace_id"),
    ("pid", dict(pid=7), "not from pid 7"),
])
def test_each_binding_check_bites(tmp_path, now, case, over, needle):
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now, duration_s=0.5, trace_id="77")
    over = dict(over)
    e = expect(now, trace_id="77")
    kw = e.__dict__ | {k: v for k, v in over.items() if not k.endswith("_shift")}
    kw["window_start"] += over.get("window_start_shift", 0)
    kw["window_end"] += over.get("window_end_shift", 0)
    v = verify_trace(str(path), Expectation(**kw))
    assert not v.ok and any(needle in p for p in v.problems), v.problems


def test_foreign_or_renamed_files_fail(tmp_path, now):
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now)
    copy = tmp_path / "rank-1_4242.json"
    copy.write_bytes(path.read_bytes())
    v = verify_trace(str(copy), expect(now))
    assert not v.ok and any("traceName" in p for p in v.problems)
    doc = json.loads(path.read_text())
    del doc["baseTimeNanoseconds"]
    path.write_text(json.dumps(doc))
    v = verify_trace(str(path), expect(now))
    assert not v.ok and any("baseTimeNanoseconds" in p for p in v.problems)


def test_a_truncated_trace_fails_and_is_checksummed_whole(tmp_path, now):
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    v = verify_trace(str(path), expect(now), chunk=100)
    assert not v.ok and v.problems[0].startswith("not valid JSON") and "truncated" in v.problems[0]
    assert v.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and v.size == path.stat().st_size
    assert path.exists()  # verification never touches the bytes


def test_missing_file_is_a_verdict_not_an_exception(tmp_path, now):
    v = verify_trace(str(tmp_path / "nope.json"), expect(now))
    assert not v.ok and "unreadable" in v.problems[0]
