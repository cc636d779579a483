"""Archiving with retries: file:// and a real S3-compatible server over HTTP, with outages."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from gpulens.capture.agent.pipeline import archive_key
from gpulens.capture.archive import ArchiveError, RetryPolicy, open_archive, put_file_retrying
from tests.s3server import CREDS, SwitchableProxy, start_moto, stop_process

BUCKET = "traces"
FAST = RetryPolicy(attempts=20, first_delay_s=0.1, max_delay_s=0.5)


@pytest.fixture(scope="module")
def moto():
    proc, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        stop_process(proc)


@pytest.fixture
def s3(moto, monkeypatch):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    import boto3
    client = boto3.client("s3", endpoint_url=moto)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


def test_archive_keys_stay_under_the_root():
    assert archive_key("file:///a", "file:///a/ns/j/0/c-1", "rank-3") == "ns/j/0/c-1/traces/rank-3.json.gz"
    assert archive_key("file:///a", "file:///a/ns/j/0/c-1", "rank-3", ".json") == "ns/j/0/c-1/traces/rank-3.json"
    assert archive_key("s3://b/root", "s3://b/root", "rank-0") == "traces/rank-0.json.gz"


async def test_file_archive_confirms_bytes(tmp_path):
    src = tmp_path / "t.json"
    src.write_bytes(os.urandom(100_000))
    store = open_archive(f"file://{tmp_path}/archive")
    uri = await put_file_retrying(store, src, "ns/j/traces/rank-0.json")
    assert store.get_bytes(uri) == src.read_bytes()
    assert src.exists()  # the caller deletes, never the uploader


async def test_s3_down_then_up_is_retried_and_archived_once(s3, moto, tmp_path):
    proxy = SwitchableProxy(int(moto.rsplit(":", 1)[1]))  # starts down: nothing listens on its port
    src = tmp_path / "rank-0_7.json"
    src.write_bytes(b'{"traceEvents": []}' + b" " * 50_000)
    store = open_archive(f"s3://{BUCKET}/root", endpoint_url=proxy.endpoint, connect_timeout=1, read_timeout=5)
    failures = []

    def on_retry(attempt, exc, pause):
        failures.append(str(exc))

    upload = asyncio.create_task(put_file_retrying(store, src, "cap-a/traces/rank-0.json", policy=FAST, on_retry=on_retry))
    while not failures:  # at least one attempt hit the outage
        assert not upload.done(), upload.result()
        await asyncio.sleep(0.05)
    await proxy.up()
    try:
        uri = await upload
    finally:
        await proxy.down()
    assert uri == f"s3://{BUCKET}/root/cap-a/traces/rank-0.json"
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="root/cap-a/")["Contents"]
    assert [o["Key"] for o in listed] == ["root/cap-a/traces/rank-0.json"]  # once
    body = s3.get_object(Bucket=BUCKET, Key="root/cap-a/traces/rank-0.json")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert failures and all("Could not connect" in f or "Connect" in f for f in failures), failures


async def test_s3_that_never_comes_back_ends_as_one_clear_error(moto, s3, tmp_path):
    proxy = SwitchableProxy(int(moto.rsplit(":", 1)[1]))
    src = tmp_path / "x.json"
    src.write_bytes(b"{}")
    store = open_archive(f"s3://{BUCKET}/root", endpoint_url=proxy.endpoint, connect_timeout=1, read_timeout=2)
    with pytest.raises(ArchiveError) as err:
        await put_file_retrying(store, src, "k.json", policy=RetryPolicy(attempts=3, first_delay_s=0.05))
    assert "after 3 attempt(s) (attempts exhausted)" in str(err.value) and not err.value.retryable
    assert src.exists()


async def test_s3_permanent_errors_are_not_retried(s3, moto, tmp_path):
    src = tmp_path / "x.json"
    src.write_bytes(b"{}")
    store = open_archive("s3://no-such-bucket/root", endpoint_url=moto)
    retries = []
    with pytest.raises(ArchiveError) as err:
        await put_file_retrying(store, src, "k.json", policy=FAST, on_retry=lambda *a: retries.append(a))
    assert "after 1 attempt(s) (not retryable)" in str(err.value) and retries == []


async def test_large_files_go_multipart(s3, moto, tmp_path):
    src = tmp_path / "big.json"
    src.write_bytes(os.urandom(11 << 20))
    store = open_archive(f"s3://{BUCKET}/root", endpoint_url=moto, multipart_threshold=5 << 20)
    uri = await put_file_retrying(store, src, "big/traces/rank-0.json")
    head = s3.head_object(Bucket=BUCKET, Key="root/big/traces/rank-0.json")
    assert head["ContentLength"] == src.stat().st_size
    assert head["ETag"].strip('"').endswith("-3")  # three parts: a multipart upload
    assert hashlib.sha256(store.get_bytes(uri)).digest() == hashlib.sha256(src.read_bytes()).digest()


def test_keys_cannot_escape_the_prefix(tmp_path):
    store = open_archive(f"file://{tmp_path}/archive")
    with pytest.raises(ArchiveError):
        store.put_bytes(b"x", "../escape.json")
