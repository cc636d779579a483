"""Streaming trace reading and verification: same answers as json.load, and every check bites."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.jsonstream import TraceStream, TraceSyntaxError
from gpulens.capture.agent.verification import Expectation, verify_trace
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


def test_a_trace_of_this_request_without_any_activity_is_empty_and_nothing_else_is(tmp_path, now):
    """Issue 45: a blocked rank's trace (Kineto: "CPU trace is empty!") is this request's, whole and
    well-formed, with no activity in it: `empty`. A trace that is also someone else's, or that has
    any activity but a requested one missing, is a plain verification failure."""
    path = kineto_like_trace(tmp_path / "rank-0_4242.json", pid=PID, start=now, cats=(), trace_id="77")
    v = verify_trace(str(path), expect(now, trace_id="77"))
    assert not v.ok and v.empty and v.problems == ["requested activity types absent: cpu_op"], v.problems
    assert not verify_trace(str(path), expect(now, trace_id="78")).empty           # not this request's
    other = tmp_path / "rank-3_4242.json"
    other.write_bytes(path.read_bytes())
    assert not verify_trace(str(other), expect(now, trace_id="77")).empty           # another file's trace
    partial = kineto_like_trace(tmp_path / "rank-1_4242.json", pid=PID, start=now, cats=("user_annotation",))
    v = verify_trace(str(partial), expect(now, activities=("cpu_op", "user_annotation")))
    assert not v.ok and not v.empty, v.problems          # it did traced work: not a blocked rank
    good = kineto_like_trace(tmp_path / "rank-2_4242.json", pid=PID, start=now)
    assert verify_trace(str(good), expect(now)).ok and not verify_trace(str(good), expect(now)).empty


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


# --- batched decoding: a guessed cut checked by the decode, orjson first, the stdlib scanner decides ---

import math  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402

import gpulens.capture.agent.jsonstream as js  # noqa: E402
from gpulens.capture.agent.verification import _Tally  # noqa: E402
from gpulens.capture.wire.limits import TRACE_FILE, JsonLimitError, load_file  # noqa: E402

# `},` `]` `[` `{` and escaped quotes inside strings and nested values: every one is a wrong cut
TRAPS = [
    {"name": "x}, {\"y", "ts": 1, "args": {"a": {"b": [{"c": 1}, {"d": "},"}]}}},
    {"name": "br]ack[et}s{ ], [", "ts": 2, "dur": 1},
    {"name": "q\"}, {\"", "ts": 3, "args": {"s": "\\", "t": "\\\"},"}},
    {"name": "\u2603 }, ] \u00e9", "ts": 4.5, "args": {"l": [[{"x": "}"}], {}], "e": {}}},
    [{"not": "an event"}, {"k": "},"}],
    {"name": "end\\", "ts": 5},
]


def trap_doc(k: int = 4, **dump) -> bytes:
    return json.dumps({"schemaVersion": 1, "traceEvents": TRAPS * k, "after": {"k": [{"z": 1}, {"z": "},"}]},
                       "traceName": "t.json"}, ensure_ascii=False, **dump).encode()


def run_stream(data: bytes, chunk: int) -> tuple[dict, js.TraceStream]:
    stream = js.TraceStream(io.BytesIO(data), chunk=chunk)
    out, events = {}, []
    for kind, item in stream:
        if kind == "event":
            events.append(item)
        else:
            out[item[0]] = events if item[0] == "traceEvents" else item[1]
    return out, stream


@pytest.mark.parametrize("dump", [{}, {"indent": 1}, {"separators": (",", ":")}])
def test_events_cut_at_every_chunk_boundary_decode_as_json_load(dump):
    """Every chunk size puts the buffer's end (so the guessed cut) somewhere else: inside strings,
    escapes, nested objects, multi-byte characters. The result is always json.load's."""
    data = trap_doc(**dump)
    want = json.loads(data)
    for chunk in list(range(1, 160)) + [509, 1024, 4096, 1 << 20]:
        got, _ = run_stream(data, chunk)
        assert got == want, chunk


def test_the_batch_path_runs_and_wrong_cuts_are_refused_not_taken(monkeypatch):
    calls = []
    real = js.TraceStream._batch

    def spy(self):
        got = real(self)
        calls.append(type(got) is tuple)
        return got
    monkeypatch.setattr(js.TraceStream, "_batch", spy)
    data = trap_doc(k=400)
    got, stream = run_stream(data, 2048)
    assert got == json.loads(data)
    assert sum(calls) >= 10 and stream.misses >= 1        # batches decoded, and wrong cuts were refused
    # the one-by-one path alone gives the same (the two paths agree)
    monkeypatch.setattr(js.TraceStream, "_batch", lambda self: -1)
    assert run_stream(data, 2048)[0] == json.loads(data)


def test_non_object_events_without_any_cut_are_read_one_by_one():
    data = json.dumps({"traceEvents": list(range(5000)) + ["}", "],"], "x": 1}).encode()
    assert run_stream(data, 1024)[0] == json.loads(data)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"', '"\\udfff x"'])
def test_what_orjson_refuses_but_json_load_takes_is_taken(value):
    """orjson is stricter than json.load here; the stdlib scanner decides, so the trace reads the same."""
    events = ",".join([f'{{"ts": {i}, "v": {value}}}' for i in range(300)])
    data = ('{"traceEvents": [' + events + '], "traceName": "t.json"}').encode()
    for chunk in (97, 4096, 1 << 20):
        got, _ = run_stream(data, chunk)
        assert json.dumps(got) == json.dumps(json.loads(data)), chunk     # dumps: NaN != NaN


GOOD = '{"ph": "X", "cat": "cpu_op", "ts": 1, "args": {"a": [1, 2]}}'


@pytest.mark.parametrize("bad", ['{"a": 01}', '{"a": "x\ty"}', '{"a": 1,}', '{"a": [1 2]}', '{"a": tru}',
                                 "{'a': 1}", '{"a": "\\x"}', '{"a": .5}', '{"a": 1.}', '{"a": +1}',
                                 '{"a": 1} {"b": 2}', '{"a": 1},,{"b": 1}', '{"a": 1}]', '{"a" 1}',
                                 '{"a": [}', '{"a": "\\u12"}', '{"a": 1e}', "{\"a\": \"\x00\"}"])
def test_malformed_events_inside_a_batch_are_errors(bad):
    data = ('{"traceEvents": [' + ",".join([GOOD] * 200 + [bad] + [GOOD] * 200) + "]}").encode()
    with pytest.raises(ValueError):
        json.loads(data)
    for chunk in (64, 4096, 1 << 20):
        with pytest.raises(TraceSyntaxError):
            run_stream(data, chunk)


def test_a_trailing_comma_before_a_trailer_with_cuts_is_an_error():
    """After a batch the next text is `]` then later keys with `},` in them: `[` + `], ...` decodes
    as an empty array, which must not pass for the end of traceEvents."""
    data = ('{"traceEvents": [' + ",".join([GOOD] * 50) + ',], "x": [{"a": 1}, {"b": 2}], "y": 1}').encode()
    for chunk in (64, 4096, 1 << 20):
        with pytest.raises(TraceSyntaxError):
            run_stream(data, chunk)


def test_every_truncation_of_a_batched_trace_is_an_error():
    data = ('{"traceEvents": [' + ",".join([GOOD] * 30) + '], "traceName": "t.json"}').encode()
    for cut in range(len(data)):
        with pytest.raises(TraceSyntaxError):
            run_stream(data[:cut], 256)
    assert run_stream(data, 256)[0] == json.loads(data)


def test_nesting_past_the_parser_limit_is_a_verdict_as_the_analysis_refuses_it(tmp_path, now):
    """capture/limits.TRACE_FILE lets the parser's recursion limit stand for traces; hitting it in
    an event or a top-level value is a failed verification, not a crash of the verifier."""
    deep = "[" * 100_000 + "]" * 100_000
    for where in ("event", "top"):
        path = kineto_like_trace(tmp_path / f"{where}_4242.json", pid=PID, start=now)
        text = path.read_text()
        if where == "event":
            text = text.replace('"traceEvents": [', '"traceEvents": [{"ts": 1, "args": ' + deep + "}, ", 1)
        else:
            text = text.replace('"traceEvents": [', '"deep": ' + deep + ', "traceEvents": [', 1)
        path.write_text(text)
        v = verify_trace(str(path), expect(now))
        assert not v.ok and v.problems[0].startswith("not valid JSON") and "max_depth" in v.problems[0], v.problems
        assert v.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        with pytest.raises(JsonLimitError) as exc:
            load_file(path, TRACE_FILE)
        assert exc.value.limit == "max_depth"
    # Kineto's own depth (args -> "Input Dims" -> [[...]]) and well beyond verifies
    path = kineto_like_trace(tmp_path / "ok_4242.json", pid=PID, start=now)
    path.write_text(path.read_text().replace('"traceEvents": [', '"traceEvents": [{"ph": "M", "args": '
                                             + "[" * 200 + "]" * 200 + "}, ", 1))
    assert verify_trace(str(path), expect(now)).ok


def test_verdict_is_the_same_at_every_chunk_size_and_no_hashing_thread_is_left(tmp_path, now):
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now, cats=("cpu_op", "user_annotation"),
                             events_per_cat=3000, trace_id="77")
    verdicts = [verify_trace(str(path), expect(now, trace_id="77", activities=("cpu_op", "user_annotation")),
                             chunk=chunk) for chunk in (100, 4096, 65536, 1 << 20)]
    assert verdicts[0].ok and verdicts[0].event_count == 6002
    assert verdicts[0].sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert all(v == verdicts[0] for v in verdicts)
    assert not [t for t in threading.enumerate() if t.name.startswith("gl-sha256")]


def _random_event(rng: random.Random, ordinary: bool):
    ev = {"ph": rng.choice(["X", "X", "X", "i", "M"]), "cat": rng.choice(
        ["cpu_op", "python_function", "kernel", "cuda_runtime", "user_annotation", None]),
        "ts": rng.choice([rng.randint(0, 10**6), rng.uniform(0, 1e6)]), "pid": rng.choice([PID, PID, PID, 0, 7, "Spans"]),
        "name": rng.choice(["aten::mm", "ProfilerStep#" + str(rng.randint(0, 99)), "Optimizer.step#SGD.step", 3])}
    if rng.random() < 0.8:
        ev["dur"] = rng.choice([rng.randint(0, 500), rng.uniform(0, 500)])
    if ev["cat"] is None:
        del ev["cat"]
    if not ordinary:
        odd = rng.choice(["ts_bool", "ts_nan", "dur_str", "cat_list", "pid_list", "not_dict", "ts_inf", "dur_bool",
                          "ts_missing"])
        if odd == "not_dict":
            return rng.choice([[], 7, "s", None])
        if odd == "ts_missing":
            del ev["ts"]
            return ev
        ev.update({"ts_bool": {"ts": True}, "ts_nan": {"ts": math.nan}, "dur_str": {"dur": "5"},
                   "cat_list": {"cat": ["x"]}, "pid_list": {"pid": [1], "cat": "cpu_op"}, "ts_inf": {"ts": math.inf},
                   "dur_bool": {"dur": False}}[odd])
    return ev


def _tally_state(t: _Tally):
    return repr((t.events, sorted(t.categories.items(), key=repr), t.ts_min, t.ts_max,
                 sorted(t.foreign_pids.items(), key=repr), t.steps, t.optimizer_steps, t.problems))


@pytest.mark.parametrize("seed", range(40))
def test_batch_checks_equal_the_per_event_checks(seed):
    """The C-level batch pass must reach exactly what the per-event loop reaches, and take the fast
    path for ordinary batches (so this test covers it)."""
    rng = random.Random(seed)
    batches = []
    for _ in range(6):
        ordinary = rng.random() < 0.6
        batch = [_random_event(rng, True) for _ in range(rng.randint(16, 300))]
        if not ordinary:
            batch[rng.randrange(len(batch))] = _random_event(rng, False)
        batches.append((ordinary, batch))
    for want_pid in (PID, None):
        fast, slow = _Tally(want_pid, []), _Tally(want_pid, [])
        for ordinary, batch in batches:
            if ordinary:
                assert _Tally(want_pid, [])._fast(batch)
            fast.batch(batch)
            for item in batch:
                slow.one(item)
        assert _tally_state(fast) == _tally_state(slow)
    assert fast.events == sum(len(b) for _, b in batches)


def _ev(ts, **kw):
    return {"ph": "X", "cat": "cpu_op", "pid": PID, "ts": ts, "dur": 1, **kw}


@pytest.mark.parametrize("name, odd", [
    ("NaN first in a later batch", [_ev(math.nan)] + [_ev(5)] + [_ev(50)] * 20),
    ("NaN dur first", [_ev(5, dur=math.nan)] + [_ev(3)] + [_ev(50)] * 20),
    ("bool ts is not a time", [_ev(50)] * 20 + [_ev(True)]),
    ("bool dur is not a duration", [_ev(50)] * 20 + [_ev(60, dur=True)]),
    ("missing ts", [_ev(50)] * 20 + [{"ph": "X", "cat": "cpu_op", "pid": PID}]),
    ("unhashable pid", [_ev(50)] * 20 + [_ev(60, pid=[PID])]),
    ("not an object", [_ev(50)] * 20 + [[_ev(1)]]),
    ("list cat", [_ev(50)] * 20 + [_ev(1, cat=["cpu_op"])]),
])
def test_odd_values_take_the_per_event_path_and_reach_its_answer(name, odd):
    first = [_ev(10)] * 20
    assert not _Tally(PID, [])._fast(odd), name
    fast, slow = _Tally(PID, []), _Tally(PID, [])
    for batch in (first, odd):
        fast.batch(batch)
        for item in batch:
            slow.one(item)
    assert _tally_state(fast) == _tally_state(slow)


def test_an_odd_category_type_is_counted_not_a_crash(tmp_path, now):
    path = tmp_path / "t_1.json"
    path.write_text(json.dumps({"schemaVersion": 1, "displayTimeUnit": "ms", "baseTimeNanoseconds": 0,
                                "traceName": str(path), "traceEvents": [{"cat": ["x"], "ph": "X", "ts": 1}] * 40}))
    v = verify_trace(str(path), Expectation(("cpu_op",), 0, 1e12, 1000))
    assert not v.ok and v.categories == {"['x']": 40}


def test_a_verifier_pool_worker_imports_only_the_verifier():
    """The agent's verifier pool spawns fresh interpreters that import `verification` through the
    `gpulens.capture.agent` package. With the package importing its client eagerly (aiohttp, the
    models' JSON Schemas) each new worker's first trace waited ~3 s of imports on a quiet machine
    and many more on a loaded one: a late trace missed the 30 s its test allows, side by side with
    other lanes. The package now imports its client on first use."""
    import subprocess
    import sys
    probe = ("import sys; from gpulens.capture.agent.verification import verify_trace; "
             "print(sorted(m for m in ('aiohttp', 'jsonschema', 'gpulens.capture.agent.client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from gpulens.capture.agent import AgentClient       # the package's own name still resolves
    assert AgentClient.__module__ == "gpulens.capture.agent.client"
