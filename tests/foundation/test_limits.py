"""gpulens.capture.wire.limits: the depth scan agrees with the parser (brackets inside strings and escapes do not
count), documents over a bound are refused naming it, and files are never read past the bound."""

from __future__ import annotations

import json

import pytest
from hypothesis import given

from gpulens.capture.wire import limits
from tests.fuzzing import FUZZ, json_values, nested


def true_depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((true_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((true_depth(x) for x in v.values()), default=0)
    return 0


@FUZZ
@given(json_values)
def test_the_scan_measures_what_the_parser_nests(value):
    assert limits.json_depth(json.dumps(value)) == true_depth(value)


@pytest.mark.parametrize("text, depth", [
    ('["[[[", "\\"[[", "\\\\", [1]]', 2),          # brackets in strings, escaped quote, escaped backslash
    ('{"a\\\\":"]]]{{{"}', 1),
    ('"[[[[[["', 0),
    ("[[[]],[[[[]]]]]", 5),
])
def test_strings_and_escapes_do_not_count(text, depth):
    assert limits.json_depth(text) == depth == true_depth(json.loads(text))


def test_too_deep_and_too_big_are_refused_naming_the_limit(tmp_path):
    lim = limits.JsonLimit("thing", 1000, 8)
    assert limits.loads(nested(8, "array"), lim) == json.loads(nested(8, "array"))
    with pytest.raises(limits.JsonLimitError) as err:
        limits.loads(nested(9, "object"), lim)
    assert err.value.limit == "max_depth" and "max_depth=8" in str(err.value) and "thing" in str(err.value)
    with pytest.raises(limits.JsonLimitError) as err:
        limits.loads(b"[" + b"1," * 600 + b"1]", lim)
    assert err.value.limit == "max_bytes" and "max_bytes=1000" in str(err.value)
    # a document nested past the interpreter's own limit is still a JsonLimitError, not a RecursionError
    for lim in (limits.MANIFEST_FILE, limits.TRACE_FILE):
        with pytest.raises(limits.JsonLimitError):
            limits.loads(nested(100_000, "array"), lim)


def test_a_file_is_read_no_further_than_its_bound(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b'["' + b"x" * (10 << 20) + b'"]')
    with pytest.raises(limits.JsonLimitError) as err:
        limits.load_file(path, limits.JsonLimit("record", 1 << 20))
    assert err.value.actual == (1 << 20) + 1  # read max_bytes + 1, not 10 MiB
    assert limits.load_file(path, limits.JsonLimit("record", 11 << 20)) == ["x" * (10 << 20)]
