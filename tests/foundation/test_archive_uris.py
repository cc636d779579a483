"""Archive URIs stay under their prefix: a crafted key or URI can never reach another job's data."""

from __future__ import annotations

import pytest

from gpulens.capture.archive import ArchiveError, join_uri, open_archive, under_prefix


@pytest.mark.parametrize("uri,ok", [
    ("file:///arch/ns/job/0/c-1/traces/rank-0.json", True),
    ("file:///arch/ns/job/0/c-1", True),
    ("file:///arch/ns/job/0/c-10/x", False),          # sibling with a common string prefix
    ("file:///arch/ns/job/0/c-1/../c-2/x", False),    # climbs out after normalisation
    ("s3://arch/ns/job/0/c-1/x", False),              # other scheme
])
def test_under_prefix(uri, ok):
    assert under_prefix("file:///arch/ns/job/0/c-1", uri) is ok


def test_s3_bucket_must_match():
    assert under_prefix("s3://bucket/p", "s3://bucket/p/a")
    assert not under_prefix("s3://bucket/p", "s3://other/p/a")


@pytest.mark.parametrize("key", ["", "../x", "a/../../x"])
def test_bad_keys_refused(key):
    with pytest.raises(ArchiveError):
        join_uri("file:///arch", key)


def test_file_store_round_trip_and_refuses_outside(tmp_path):
    store = open_archive(f"file://{tmp_path}/arch/c-1")
    src = tmp_path / "t.json"
    src.write_bytes(b'{"traceEvents": []}')
    uri = store.put_file(src, "traces/rank-0.json")
    assert uri == f"file://{tmp_path}/arch/c-1/traces/rank-0.json"
    assert store.get_bytes(uri) == src.read_bytes() and store.exists(uri)
    (tmp_path / "arch" / "secret").write_text("no")
    with pytest.raises(ArchiveError):
        store.get_bytes(f"file://{tmp_path}/arch/secret")
    assert not list((tmp_path / "arch" / "c-1" / "traces").glob(".*.part"))  # no temp file left


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ArchiveError, match="unsupported archive URI"):
        open_archive("http://example.invalid/x")
