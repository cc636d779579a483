"""Fixtures for the analysis tests: capture folders built like the archive layout, real traces.

A capture is laid out exactly as docs/ARCHITECTURE.md "Archive layout" says:
`<root>/<namespace>/<job>/<attempt>/<capture_id>/traces/<target_id>.json[.gz]` plus `manifest.json`,
and its manifest is produced by `gpulens.capture.models.Manifest` (so it is schema-valid by construction).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpulens.capture.models import Artifact, ExpectedTarget, Failure, Manifest
from tests.conftest import missing

HERE = Path(__file__).resolve().parent
SHARED_TRACES = HERE.parent.parent.parent / "shared" / "data" / "traces"


@dataclass
class Capture:
    dir: Path
    manifest_uri: str
    manifest: Manifest

    def trace(self, target_id: str) -> Path:
        return next((self.dir / "traces").glob(f"{target_id}.json*"))  # not its .analysis.json

    def summary(self) -> dict:
        return json.loads((self.dir / "analysis" / "summary.json").read_text())


@dataclass
class CaptureBuilder:
    root: Path
    capture_id: str = "c-test"
    job: str = "train"
    namespace: str = "ns"
    attempt: int = 0
    duration_ms: int = 3000
    artifacts: list[Artifact] = field(default_factory=list)
    expected: list[ExpectedTarget] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    #: None: just before the first added trace starts, as for a real capture of that trace
    requested_at: float | None = None
    _first_start: float | None = None
    request: dict = field(default_factory=lambda: {"reason": {"kind": "manual", "requested_by": "test"}})

    @property
    def dir(self) -> Path:
        return self.root / self.namespace / self.job / str(self.attempt) / self.capture_id

    def add(self, rank: int, source: Path | bytes, *, target_id: str | None = None, file_name: str | None = None,
            pod: str = "trainer-0", node: str = "node-a", uri: str | None = None, expect: bool = True,
            sizes: dict | None = None, worker_rank: int | None = None,
            iterations: dict | None = None) -> "CaptureBuilder":
        target_id = target_id or f"rank-{rank}"
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        if file_name is None:
            file_name = target_id + (".json.gz" if isinstance(source, Path) and source.name.endswith(".gz") else ".json")
        dest = self.dir / "traces" / file_name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        if not self.artifacts:
            self._first_start = trace_start(data)
        self.artifacts.append(Artifact(target_id=target_id, rank=rank, local_rank=rank % 8, node=node, pod=pod,
                                       pid=1000 + rank, attempt=self.attempt, uri=uri or dest.as_uri(),
                                       size=len(data), sha256=hashlib.sha256(data).hexdigest(), trace_id=None,
                                       sizes=sizes, worker_rank=worker_rank, iterations=iterations))
        if expect:
            self.expected.append(ExpectedTarget(target_id, rank, rank % 8, pod, node))
        return self

    def expect(self, rank: int, *, pod: str = "trainer-1", node: str = "node-b") -> "CaptureBuilder":
        self.expected.append(ExpectedTarget(f"rank-{rank}", rank, rank % 8, pod, node))
        return self

    def fail(self, rank: int, reason: str, detail: str) -> "CaptureBuilder":
        self.failures.append(Failure(f"rank-{rank}", reason, detail, rank))
        return self

    def write(self) -> Capture:
        requested_at = self.requested_at
        if requested_at is None:
            requested_at = self._first_start - 1.0 if self._first_start is not None else time.time()
        m = Manifest(capture_id=self.capture_id, job_id=self.job, attempt=self.attempt, requested_at=requested_at,
                     duration_ms=self.duration_ms, expected_targets=self.expected, artifacts=self.artifacts,
                     failures=self.failures, archive_prefix=self.dir.as_uri(),
                     request=self.request)
        path = self.dir / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(m.to_json())
        return Capture(self.dir, path.as_uri(), m)


def trace_start(data: bytes) -> float | None:
    """Unix start time of a Kineto trace (baseTimeNanoseconds + first complete event), if knowable."""
    try:
        doc = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
        ts = min(e["ts"] for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
                 and isinstance(e.get("ts"), (int, float)))
    except (ValueError, KeyError, TypeError, OSError, EOFError):
        return None
    base = doc.get("baseTimeNanoseconds")
    if isinstance(base, int) and base > 0:
        return base / 1e9 + ts / 1e6
    return ts / 1e6 if ts >= 1e14 else None  # epoch-µs (trace_inspection._EPOCH_US_THRESHOLD)


@pytest.fixture
def builder(tmp_path):
    return lambda **kw: CaptureBuilder(root=tmp_path / "archive", **kw)


@pytest.fixture(scope="session")
def trace_filter() -> list[Path]:
    """The genuine 2-rank GPU+NCCL set from HTA's test data (ranks 0 and 1 of one 128-rank job)."""
    d = SHARED_TRACES / "hta_trace_filter_2rank"
    if not d.is_dir():
        missing(f"shared trace data not found at {d}")
    return [d / "sampled_rank-0.json.gz", d / "sampled_rank-1.json.gz"]


@pytest.fixture(scope="session")
def cpu_only_assembled() -> dict[int, Path]:
    d = SHARED_TRACES / "hta_cpu_only_2rank_assembled"
    if not d.is_dir():
        missing(f"shared trace data not found at {d}")
    return {34: d / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", 0: d / "rank_non_gpu.json.gz"}


@pytest.fixture(scope="session")
def torch_traces(tmp_path_factory) -> Path:
    """Real PyTorch CPU traces for ranks 0 and 1 (see torch_traces.py), made once per session."""
    out = tmp_path_factory.mktemp("torch-traces")
    procs = [subprocess.Popen([sys.executable, str(HERE / "torch_traces.py"), str(out), str(r)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


DDP_WORLD, DDP_SLOW_RANK = 4, 2


@pytest.fixture(scope="session")
def ddp_traces(tmp_path_factory) -> Path:
    """Real traces of a 4-rank DDP (gloo) torch job whose rank 2 has a slow input pipeline (ddp_traces.py)."""
    return _ddp_run(tmp_path_factory.mktemp("ddp-traces"))


@pytest.fixture(scope="session")
def ddp_plain_traces(tmp_path_factory) -> Path:
    """The same job as a loop that never calls `prof.step()`: no ProfilerStep#N markers in its traces."""
    return _ddp_run(tmp_path_factory.mktemp("ddp-plain-traces"), "plain")


def _ddp_run(out: Path, *mode: str) -> Path:
    procs = [subprocess.Popen([sys.executable, str(HERE / "ddp_traces.py"), str(out), str(r), str(DDP_WORLD),
                               str(DDP_SLOW_RANK), *mode], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(DDP_WORLD)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def raw_events(path: Path) -> list[dict]:
    import gzip
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return json.load(f)["traceEvents"]

