"""The archive path rule (capture/archive/paths.py): every escape, plain, percent-encoded or doubly
encoded, is refused by `under_prefix`, `join_uri` and both stores, and a canary file outside the
root is never read, written or replaced; S3 keys are refused before any request is made."""

from __future__ import annotations

import os

import pytest

from gpulens.capture.archive import ArchiveError, join_uri, open_archive, under_prefix

#: ways to spell "go up two folders and name canary.json"; each must be refused
ESCAPES = ["../../canary.json", "%2e%2e/%2e%2e/canary.json", "%2E%2E/%2E%2E/canary.json", ".%2e/%2e./canary.json",
           "%252e%252e/%252e%252e/canary.json", "%25252e%25252e/%25252e%25252e/canary.json",
           "..%2f..%2fcanary.json", "%2e%2e%2f%2e%2e%2fcanary.json", "%252e%252e%252f%252e%252e%252fcanary.json",
           "..%5c..%5ccanary.json", "%2e%2e%5ccanary.json", "x%00/../../canary.json", "x%2500.json",
           "./../../canary.json", "%2e/%2e%2e/%2e%2e/canary.json", "a//../../canary.json", "traces/../../../canary.json"]


@pytest.fixture
def layout(tmp_path):
    root = tmp_path / "arch" / "root"
    root.mkdir(parents=True)
    canary = tmp_path / "arch" / "canary.json"
    canary.write_bytes(b'{"traceEvents": [], "canary": true}')
    return root, canary


def snapshot(tmp_path, root):
    """Every file outside the root with its bytes and mtime: nothing may appear, change or vanish."""
    out = {}
    for dirpath, _, files in os.walk(tmp_path):
        for f in files:
            p = os.path.join(dirpath, f)
            if not p.startswith(str(root) + os.sep):
                out[p] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


@pytest.mark.parametrize("escape", ESCAPES)
def test_no_spelling_of_an_escape_reads_or_writes_outside_the_root(tmp_path, layout, escape):
    root, canary = layout
    before = snapshot(tmp_path, root)
    prefix = root.as_uri()
    uri = f"{prefix}/{escape}"
    assert not under_prefix(prefix, uri)
    with pytest.raises(ArchiveError):
        join_uri(prefix, escape)
    store = open_archive(prefix)
    src = tmp_path / "src.json"
    src.write_bytes(b"{}")
    before[str(src)] = (b"{}", os.stat(src).st_mtime_ns)
    for op in (lambda: store.get_bytes(uri), lambda: store.download(uri, tmp_path / "dl.json"),
               lambda: store.exists(uri), lambda: store.put_file(src, escape), lambda: store.put_bytes(b"x", escape)):
        with pytest.raises(ArchiveError):
            op()
    with pytest.raises(ArchiveError):  # a store rooted at an escaping prefix is refused outright
        open_archive(f"{prefix}/{escape.rsplit('/', 1)[0]}")
    assert snapshot(tmp_path, root) == before
    assert canary.read_bytes() == b'{"traceEvents": [], "canary": true}'


@pytest.mark.parametrize("uri", ["file://evil/arch/root/x", "file://%2e%2e/arch/root/x", "s3://b%2fother/p/x",
                                 "s3://user:pw@b/p/x", "s3://other/p/x", "s3:///p/x", "http://b/p/x",
                                 "s3://b/p/x?versionId=1", "s3://b/p/x#frag", "s3://b/p/x\n", "s3://b/p\x00/x"])
def test_another_netloc_scheme_query_or_control_character_is_not_under_the_prefix(uri):
    assert not under_prefix("s3://b/p", uri) and not under_prefix("file:///arch/root", uri)


def test_plain_keys_still_work_and_decode_once(tmp_path, layout):
    root, _ = layout
    store = open_archive(root.as_uri())
    uri = store.put_bytes(b"{}", "traces/rank-0.json")
    assert store.get_bytes(uri) == b"{}" and (root / "traces" / "rank-0.json").is_file()
    # an encoded ordinary character names the same object (decoded before use, as it was checked)
    assert store.get_bytes(f"{root.as_uri()}/traces/rank%2D0.json") == b"{}"
    from gpulens.capture.archive import archive_path
    assert archive_path("s3://b/p/a%20b/c").segments == ("p", "a b", "c")


def test_s3_refuses_escaping_keys_before_any_request():
    """The check runs before boto3 is asked: a client that records calls sees none."""
    calls = []

    class Recorder:  # stands for boto3's S3 client; any call would be a request to S3
        def __getattr__(self, name):
            return lambda *a, **kw: calls.append(name)

    store = open_archive("s3://bucket/ns/job/0/c-1", client=Recorder())
    for escape in ESCAPES:
        for op in (lambda: store.get_bytes(f"s3://bucket/ns/job/0/c-1/{escape}"),
                   lambda: store.put_bytes(b"x", escape)):
            with pytest.raises(ArchiveError):
                op()
    assert calls == []
    store.put_bytes(b"x", "traces/rank-0.json")
    assert calls == ["put_object"]
