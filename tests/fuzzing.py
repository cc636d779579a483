"""Hypothesis strategies for hostile HTTP input, shared by the API fuzz tests of every component.

Bodies: arbitrary JSON, valid bodies with one field replaced by arbitrary JSON, bodies nested far
past gpulens.capture.wire.limits.MAX_DEPTH (the RecursionError that used to be a 500), raw bytes that are not
JSON or not UTF-8. Path segments: arbitrary text, percent-encoded, with newlines and `..`.
The property every API must keep: no 5xx, a JSON error body, and still serving afterwards.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: bounded so each fuzz test takes seconds; servers are shared by the examples of one test
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                           max_leaves=20)


def nested(depth: int, kind: str) -> bytes:
    """`depth` nested arrays or objects, as bytes (built flat: no recursion here either)."""
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


deep_bodies = st.builds(nested, st.integers(65, 5000), st.sampled_from(["array", "object"]))
raw_bodies = st.binary(max_size=200) | st.sampled_from([b"", b"{", b"\xff\xfe", b'{"a": "\xc3"}', b"nul\x00",
                                                        b"[" * 100_000, b'"' + b"\\" * 999 + b'"'])


def mutated(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """`valid` with one key replaced by (or added as) arbitrary JSON, serialized."""
    keys = st.sampled_from(sorted(valid)) | st.text(max_size=10)
    return st.builds(lambda k, v: json.dumps({**valid, k: v}).encode(), keys, json_values)


def bodies(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return (mutated(valid) | json_values.map(lambda v: json.dumps(v).encode()) | deep_bodies | raw_bodies)


#: one URL path segment, already percent-encoded (as a client would put it on the wire)
segments = (st.text(max_size=30).map(lambda s: quote(s, safe="")) |
            st.sampled_from(["..", "%2e%2e", "%252e%252e", "c-aaaaaaaaaaaa%0a", "c-aaaaaaaaaaaa%0A", "rank-0%00",
                             "rank-0%0a", "%2F..%2F", "a" * 300, "c-%E2%80%AEabc"]))


def assert_no_server_error(status: int, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    if status >= 400:
        doc = json.loads(body)  # every refusal is a JSON body, never a stack trace or a text page
        assert isinstance(doc, dict) and "error" in doc, f"{what}: {body[:300]!r}"
