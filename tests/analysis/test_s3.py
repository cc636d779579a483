"""s3:// archives, against a real S3-compatible server (moto in server mode) on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.models import Artifact, ExpectedTarget, Manifest
from tests.analysis.conftest import trace_start
from tests.conftest import free_port
from tests.s3server import CREDS, start_moto, stop_process

BUCKET = "gpulens-archive"
PREFIX = "ns/train/0"
S3_CLIENT_CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    proc, endpoint = start_moto()
    try:
        import boto3
        client = boto3.client("s3", endpoint_url=endpoint, **S3_CLIENT_CREDS)
        client.create_bucket(Bucket=BUCKET)
        yield endpoint, client
    finally:
        stop_process(proc)


def _upload_capture(client, capture_id: str, traces: list[Path]) -> str:
    base = f"{PREFIX}/{capture_id}"
    artifacts, expected = [], []
    for rank, path in enumerate(traces):
        data = path.read_bytes()
        key = f"{base}/traces/rank-{rank}.json.gz"
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
        artifacts.append(Artifact(f"rank-{rank}", rank, rank, "node-a", "trainer-0", 100 + rank, 0,
                                  f"s3://{BUCKET}/{key}", len(data), hashlib.sha256(data).hexdigest(), None))
        expected.append(ExpectedTarget(f"rank-{rank}", rank, rank, "trainer-0", "node-a"))
    requested_at = trace_start(traces[0].read_bytes()) - 1.0  # as a real capture of these traces
    m = Manifest(capture_id, "train", 0, requested_at, 3000, expected, artifacts, archive_prefix=f"s3://{BUCKET}/{base}")
    client.put_object(Bucket=BUCKET, Key=f"{base}/manifest.json", Body=m.to_json().encode())
    return f"s3://{BUCKET}/{base}/manifest.json"


def _analyze(uri: str, endpoint: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **CREDS}
    return subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", uri, "--s3-endpoint", endpoint],
                          capture_output=True, text=True, timeout=300, env=env)


def test_analysis_reads_and_writes_s3(s3, trace_filter):
    endpoint, client = s3
    uri = _upload_capture(client, "c-s3", trace_filter)
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/c-s3/traces/rank-7.json.gz", Body=b"never named, never read")
    out = _analyze(uri, endpoint)
    assert out.returncode == 0, out.stderr
    report_uri = f"s3://{BUCKET}/{PREFIX}/c-s3/analysis/report.html"
    assert out.stdout == report_uri + "\n"
    summary = json.loads(client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/c-s3/analysis/summary.json")["Body"].read())
    assert summary["status"] == "analysed" and summary["outputs"]["report_uri"] == report_uri
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert [r["overlap_pct"] for r in summary["analyses"]["comm_comp_overlap"]["result"]["per_rank"]] == [11.81, 20.05]
    report = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/c-s3/analysis/report.html")
    assert report["ContentType"].startswith("text/html") and b"Plotly.newPlot" in report["Body"].read()


def test_tampered_s3_object_is_excluded(s3, trace_filter):
    endpoint, client = s3
    uri = _upload_capture(client, "c-s3-tampered", trace_filter)
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/c-s3-tampered/traces/rank-1.json.gz",
                      Body=trace_filter[0].read_bytes())  # a valid trace, but not the recorded one
    out = _analyze(uri, endpoint)
    assert out.returncode == 0, out.stderr
    summary = json.loads(client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/c-s3-tampered/analysis/summary.json")["Body"].read())
    assert {r["rank"]: (r["status"], r["reason"]) for r in summary["ranks"]} == {
        0: ("analysed", None), 1: ("excluded", "checksum_mismatch")}


def test_missing_manifest_and_unreachable_s3_are_clear_errors(s3):
    endpoint, _ = s3
    out = _analyze(f"s3://{BUCKET}/{PREFIX}/no-such-capture/manifest.json", endpoint)
    assert out.returncode == 2 and "cannot read manifest" in out.stderr and out.stdout == ""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = _analyze(f"s3://{BUCKET}/{PREFIX}/c-s3/manifest.json", dead)
    assert out.returncode == 2 and "cannot read manifest" in out.stderr and out.stdout == ""
