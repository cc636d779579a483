"""The archive copy written in the verifier's one pass: gzip of exactly the trace's bytes, sha256 of
what is stored, kept only for a trace that verified, and never allowed to fill its disk."""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import threading
import time

import pytest

from gpulens.capture.agent import staging
from gpulens.capture.agent.staging import Staging
from gpulens.capture.agent.verification import Expectation, verify_trace
from tests.agent.conftest import kineto_like_trace
from tests.tinyfs import tiny_fs

PID = 4242


def expect(start: float) -> Expectation:
    return Expectation(("cpu_op",), window_start=start - 5, window_end=start + 30, duration_ms=500, pid=PID)


@pytest.mark.parametrize("codec", ["isal", "zlib"])
@pytest.mark.parametrize("chunk", [100, 65536, 1 << 20])
def test_the_stored_copy_is_the_gzip_of_the_trace_and_the_checksum_is_of_the_stored_bytes(tmp_path, codec, chunk):
    now = time.time()
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now, events_per_cat=5000)
    raw = path.read_bytes()
    dest = tmp_path / "stage" / "rank-0.json.gz"
    dest.parent.mkdir()
    v = verify_trace(str(path), expect(now), chunk=chunk, stage=Staging(str(dest), codec=codec))
    assert v.ok, v.problems
    stored = dest.read_bytes()
    assert v.stored_path == str(dest) and v.encoding == "gzip"
    assert gzip.decompress(stored) == raw                      # the same bytes, in a format HTA and Perfetto read
    assert v.sha256 == hashlib.sha256(stored).hexdigest() != hashlib.sha256(raw).hexdigest()
    assert v.stored_size == len(stored) < len(raw) // 4 and v.size == len(raw)
    assert sorted(os.listdir(dest.parent)) == ["rank-0.json.gz"]   # no .part left
    assert path.read_bytes() == raw                            # the trace itself is untouched
    assert not [t for t in threading.enumerate() if t.name.startswith("gl-sha256")]


def test_without_staging_the_checksum_stays_the_raw_files(tmp_path):
    now = time.time()
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID, start=now)
    v = verify_trace(str(path), expect(now))
    assert v.ok and v.stored_path is None and v.encoding == "identity"
    assert v.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and v.stored_size == v.size


@pytest.mark.parametrize("damage", ["truncated", "wrong_pid"])
def test_a_trace_that_fails_keeps_no_copy(tmp_path, damage):
    now = time.time()
    path = kineto_like_trace(tmp_path / "t_4242.json", pid=PID if damage == "truncated" else 7, start=now,
                             events_per_cat=3000)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-5000])
    dest = tmp_path / "rank-0.json.gz"
    v = verify_trace(str(path), expect(now), chunk=4096, stage=Staging(str(dest)))
    assert not v.ok and v.stored_path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t_4242.json"]   # neither the copy nor its .part


def _incompressible_trace(path, now: float, n: int):
    """A valid trace whose args are random hex: gzip cannot shrink it much."""
    rng = random.Random(7)
    path = kineto_like_trace(path, pid=PID, start=now, events_per_cat=n)
    text = path.read_text().replace('"args": {"External id"', '"args": {"blob": "%s", "External id"')
    parts = text.split("%s")
    path.write_text("".join(p + (rng.randbytes(200).hex() if i < len(parts) - 1 else "") for i, p in enumerate(parts)))
    return path


def test_a_full_staging_disk_stops_the_copy_and_leaves_nothing(tmp_path):
    """ENOSPC from the kernel (a 256 KiB tmpfs): the copy stops, its part file goes, the verdict says
    why in `stage_error` (the trace itself verified and stays)."""
    fs = tiny_fs(tmp_path / "tiny", size="256k")
    try:
        now = time.time()
        path = _incompressible_trace(tmp_path / "t_4242.json", now, 3000)
        assert path.stat().st_size > 1 << 20
        v = verify_trace(str(path), expect(now), chunk=65536, stage=Staging(str(fs.path / "rank-0.json.gz")))
        assert v.ok and v.stored_path is None and v.sha256 == ""
        assert "No space left" in (v.stage_error or ""), v.stage_error
        assert fs.files() == []
    finally:
        fs.close()


def test_the_copy_stops_before_the_disk_is_down_to_its_reserve(tmp_path, monkeypatch):
    """min_free_bytes: the copy stops (and goes) once its filesystem would keep less free: a reserve
    of 600 KiB on a 1 MiB tmpfs stops a ~700 KiB copy, long before ENOSPC."""
    monkeypatch.setattr(staging, "FREE_CHECK_BYTES", 64 << 10)
    fs = tiny_fs(tmp_path / "tiny", size="1m")
    try:
        now = time.time()
        path = _incompressible_trace(tmp_path / "t_4242.json", now, 3000)
        v = verify_trace(str(path), expect(now), chunk=65536,
                         stage=Staging(str(fs.path / "rank-0.json.gz"), min_free_bytes=600 << 10))
        assert v.ok and v.stored_path is None
        assert "keeps at least 614400 free" in (v.stage_error or ""), v.stage_error
        assert fs.files() == []
        st = os.statvfs(fs.path)
        assert st.f_bavail * st.f_frsize > 400 << 10    # it never ran the disk down
    finally:
        fs.close()
