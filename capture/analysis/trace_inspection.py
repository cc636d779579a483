"""Verify one fetched trace file and learn what it contains, before HTA ever sees it.

Runs in a worker (one file at a time per worker), next to HTA's parse of the same rank. The file
is read as a stream (the agent verifier's reader), so this step holds one batch of events, never
the whole document: HTA's own parse is what a worker's memory must fit. Per file, in this order:

1. the sha256 (and size) of the fetched bytes must equal the manifest's, else the rank is excluded;
2. the content must be a Kineto JSON trace (gzip sniffed from the bytes, not trusted from the name),
   decompressing to at most `max_bytes`;
3. its facts are collected (GPU activity, NCCL kernels, ProfilerStep annotations, clock base, rank);
4. an HTA-ready copy is written: `rank-<r>.json[.gz]`, with `"distributedInfo": {"rank": r}`
   inserted when the file has none (Kineto on-demand traces never do). The fetched copy is left as
   it was; the archive is never written.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

# The agent verifier's streaming reader: the same acceptance as json.load, one batch in memory.
from gpulens.capture.agent.jsonstream import TraceStream, TraceSyntaxError

from .exclusions import Exclusion

__all__ = ["TraceFacts", "InspectJob", "Inspected", "inspect_trace", "DEFAULT_MAX_TRACE_BYTES"]

DEFAULT_MAX_TRACE_BYTES = 4 << 30
_GZIP_MAGIC = b"\x1f\x8b"
_COMM_KERNEL = re.compile(r"^nccl.*Kernel")   # HTA's own rule (hta/utils/utils.py is_comm_kernel)
#: Kineto timestamps are µs; anything after ~1973 in µs is an absolute epoch clock
_EPOCH_US_THRESHOLD = 1e14


@dataclass(frozen=True)
class TraceFacts:
    """What one trace holds, enough to choose analyses and to check ranks share a clock."""

    events: int                 # entries of traceEvents
    complete_events: int        # ph X with ts, dur, cat, name, pid, tid: the rows HTA keeps
    cpu_ops: int
    user_annotations: int
    kernels: int                # cat == "kernel"
    gpu_events: int             # args.stream >= 0 and args.correlation >= 0: HTA's test for GPU rows
    comm_kernels: int           # kernels named ^nccl.*Kernel
    nccl_legacy_kernels: int    # named ncclKernel*: the only naming HTA's straggler code knows (0.6.1 too)
    profiler_steps: int         # ProfilerStep#N annotations
    ts_min_us: float
    ts_max_us: float
    base_time_ns: int | None    # baseTimeNanoseconds: newer Kineto writes ts relative to it
    distributed_rank: int | None
    world_size: int | None
    compressed: bool
    rank_inserted: bool         # the HTA copy got a distributedInfo this file did not have

    @property
    def clock(self) -> str:
        """Which clock the timestamps are on: ranks of one job share it (HTA aligns by raw ts)."""
        if self.base_time_ns is not None:
            return f"base:{self.base_time_ns}"
        return "epoch_us" if self.ts_min_us >= _EPOCH_US_THRESHOLD else "relative_unknown"

    @property
    def start_epoch_s(self) -> float | None:
        """Absolute start time in seconds, when the clock makes that knowable."""
        if self.base_time_ns is not None:
            return self.base_time_ns / 1e9 + self.ts_min_us / 1e6
        if self.ts_min_us >= _EPOCH_US_THRESHOLD:
            return self.ts_min_us / 1e6
        return None

    @property
    def end_epoch_s(self) -> float | None:
        """Absolute end time (last complete event's end) in seconds, when knowable."""
        start = self.start_epoch_s
        return None if start is None else start + max(0.0, self.ts_max_us - self.ts_min_us) / 1e6

    def to_dict(self) -> dict:
        return {"events": self.events, "complete_events": self.complete_events, "cpu_ops": self.cpu_ops,
                "user_annotations": self.user_annotations, "kernels": self.kernels, "gpu_events": self.gpu_events,
                "comm_kernels": self.comm_kernels, "profiler_steps": self.profiler_steps,
                "duration_us": max(0.0, self.ts_max_us - self.ts_min_us), "clock": self.clock,
                "start_epoch_s": self.start_epoch_s, "distributed_rank": self.distributed_rank,
                "world_size": self.world_size, "compressed": self.compressed, "rank_inserted": self.rank_inserted}


@dataclass(frozen=True)
class InspectJob:
    rank: int
    target_id: str
    path: str
    sha256: str
    size: int
    hta_dir: str
    max_bytes: int = DEFAULT_MAX_TRACE_BYTES


@dataclass(frozen=True)
class Inspected:
    rank: int
    target_id: str
    facts: TraceFacts | None = None
    hta_path: str | None = None
    exclusion: Exclusion | None = None
    detail: str = ""


class _Reject(Exception):
    def __init__(self, exclusion: Exclusion, detail: str):
        super().__init__(detail)
        self.exclusion, self.detail = exclusion, detail


def inspect_trace(job: InspectJob) -> Inspected:
    """Verify, inspect and stage one trace; never raises for bad input (it excludes the rank)."""
    try:
        _check_digest(job)
        facts = _facts(job)
        hta_path = _stage_for_hta(job, facts)
        if hta_path is None:  # the copy needed no patch: stage the verified file itself
            hta_path = _link_or_copy(Path(job.path), job, facts.compressed)
        facts = replace(facts, rank_inserted=facts.distributed_rank is None)
        return Inspected(job.rank, job.target_id, facts=facts, hta_path=str(hta_path))
    except _Reject as rej:
        return Inspected(job.rank, job.target_id, exclusion=rej.exclusion, detail=rej.detail)
    except OSError as exc:
        return Inspected(job.rank, job.target_id, exclusion=Exclusion.UNREADABLE, detail=f"reading trace: {exc}")
    except MemoryError:
        return Inspected(job.rank, job.target_id, exclusion=Exclusion.UNREADABLE,
                         detail="out of memory while parsing the trace")
    except Exception as exc:  # noqa: BLE001 - one odd file must cost its rank, not the whole analysis
        return Inspected(job.rank, job.target_id, exclusion=Exclusion.UNREADABLE,
                         detail=f"inspection failed: {type(exc).__name__}: {exc}"[:500])


def _check_digest(job: InspectJob) -> None:
    h, size = hashlib.sha256(), 0
    with open(job.path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    digest = h.hexdigest()
    if digest != job.sha256 or size != job.size:
        raise _Reject(Exclusion.CHECKSUM_MISMATCH,
                      f"fetched {size} bytes with sha256 {digest}; the manifest recorded {job.size} bytes "
                      f"with sha256 {job.sha256}")


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


@contextmanager
def _content(path: str, compressed: bool):
    """The trace's JSON bytes as a file (decompressed on the fly); a broken gzip stream is a _Reject."""
    try:
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
            yield f
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise _Reject(Exclusion.UNREADABLE, f"corrupt gzip stream: {exc}") from exc


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Tally:
    """The facts of the events seen so far, one batch at a time."""

    def __init__(self) -> None:
        self.events = self.complete = self.cpu_ops = self.annotations = self.kernels = 0
        self.gpu = self.comm = self.legacy = self.steps = 0
        self.ts_min, self.ts_max = float("inf"), float("-inf")

    def batch(self, events: list) -> None:
        self.events += len(events)
        for e in events:
            if not isinstance(e, dict) or e.get("ph") != "X":
                continue
            ts, dur, cat, name = e.get("ts"), e.get("dur"), e.get("cat"), e.get("name")
            if not (_num(ts) and _num(dur) and isinstance(cat, str) and isinstance(name, str)
                    and "pid" in e and "tid" in e):
                continue
            self.complete += 1
            self.ts_min, self.ts_max = min(self.ts_min, ts), max(self.ts_max, ts + dur)
            if cat == "cpu_op":
                self.cpu_ops += 1
            elif cat == "user_annotation":
                self.annotations += 1
            elif cat == "kernel":
                self.kernels += 1
                if _COMM_KERNEL.match(name):
                    self.comm += 1
                    self.legacy += name.startswith("ncclKernel")
            if name.startswith("ProfilerStep#"):
                self.steps += 1
            args = e.get("args")
            if isinstance(args, dict):
                stream, corr = args.get("stream"), args.get("correlation")
                if _num(stream) and _num(corr) and stream >= 0 and corr >= 0:
                    self.gpu += 1


def _facts(job: InspectJob) -> TraceFacts:
    """One streaming pass (gpulens.capture.agent.jsonstream, the agent verifier's reader): memory stays at
    about one batch of events, not the ~6x of the file that `json.loads` of the whole text took
    (it was the largest part of an analysis worker's peak, BENCHMARKS.md "Analysis at scale")."""
    compressed = _is_gzip(job.path)
    tally, top, seen = _Tally(), {}, [0]

    def count(raw: bytes) -> None:
        seen[0] += len(raw)
        if seen[0] > job.max_bytes:
            raise _Reject(Exclusion.UNREADABLE, f"trace decompresses to more than {job.max_bytes} bytes")

    with _content(job.path, compressed) as f:
        first = _first_char(f)
        if first == b"[":
            raise _Reject(Exclusion.UNREADABLE, "not a Kineto trace: no top-level traceEvents array "
                                                "(the top level is an array)")
        try:
            for kind, item in TraceStream(f, on_bytes=count, batches=True):
                if kind == "key":
                    name, value = item
                    if name in ("traceEvents", "distributedInfo", "baseTimeNanoseconds"):
                        top[name] = value
                else:
                    tally.batch(item)
        except UnicodeDecodeError as exc:
            raise _Reject(Exclusion.UNREADABLE, f"not JSON: {str(exc)[:200]}") from exc
        except TraceSyntaxError as exc:
            raise _Reject(Exclusion.UNREADABLE, f"not JSON: {str(exc)[:200]}") from exc
    if "traceEvents" not in top or top["traceEvents"] is not None:   # None: it was the array streamed
        raise _Reject(Exclusion.UNREADABLE, "not a Kineto trace: no top-level traceEvents array")
    if tally.complete == 0:
        raise _Reject(Exclusion.UNREADABLE, "no complete events (ph X with ts, dur, cat, name, pid, tid): "
                                            "nothing for HTA to analyse")
    dist = top.get("distributedInfo") if isinstance(top.get("distributedInfo"), dict) else {}
    rank, world = _int_or_none(dist.get("rank")), _int_or_none(dist.get("world_size"))
    return TraceFacts(
        events=tally.events, complete_events=tally.complete, cpu_ops=tally.cpu_ops,
        user_annotations=tally.annotations, kernels=tally.kernels, gpu_events=tally.gpu, comm_kernels=tally.comm,
        nccl_legacy_kernels=tally.legacy, profiler_steps=tally.steps, ts_min_us=float(tally.ts_min),
        ts_max_us=float(tally.ts_max), base_time_ns=_int_or_none(top.get("baseTimeNanoseconds")),
        distributed_rank=rank if rank is not None and rank >= 0 else None, world_size=world,
        compressed=compressed, rank_inserted=False)


def _first_char(f) -> bytes:
    """The first significant byte (after a BOM and whitespace); the file is rewound."""
    head = f.read(64)
    f.seek(0)
    return head.lstrip(b"\xef\xbb\xbf").lstrip(b" \t\r\n")[:1]


def _hta_name(job: InspectJob, compressed: bool) -> Path:
    # HTA opens with gzip iff the name ends in "gz": the name must follow the content
    return Path(job.hta_dir) / f"rank-{job.rank}.json{'.gz' if compressed else ''}"


def _stage_for_hta(job: InspectJob, facts: TraceFacts) -> Path | None:
    """Write a patched copy when distributedInfo is missing; None when the file can be used as is.
    Streamed: the object's opening brace, the inserted key, then the rest, a chunk at a time."""
    if facts.distributed_rank is not None:
        return None
    insert = b'"distributedInfo": {"rank": %d}, ' % job.rank
    dest = _hta_name(job, facts.compressed)
    with _content(job.path, facts.compressed) as src, \
            (gzip.open(dest, "wb", compresslevel=1) if facts.compressed else open(dest, "wb")) as out:
        head = src.read(1 << 20)
        brace = head.index(b"{")  # the document is a JSON object (inspected), so its first token is "{"
        out.write(head[:brace + 1])
        out.write(insert)
        out.write(head[brace + 1:])
        shutil.copyfileobj(src, out, 8 << 20)
    return dest


def _link_or_copy(src: Path, job: InspectJob, compressed: bool) -> Path:
    dest = _hta_name(job, compressed)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest
