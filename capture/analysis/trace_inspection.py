"""Verify one fetched trace file and learn what it contains, before HTA ever sees it.

Runs in a worker process (one file at a time per worker), because parsing a trace costs several
times its size in memory and the main process must stay small: it later forks HTA's parsers and
holds every rank's DataFrame. Per file, in this order:

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
from dataclasses import dataclass, replace
from pathlib import Path

from capture import limits

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
        data, compressed = _read_content(job)
        facts = _facts(data, compressed)
        hta_path = _stage_for_hta(job, data, facts)
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


def _read_content(job: InspectJob) -> tuple[bytearray, bool]:
    with open(job.path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
    opener = gzip.open if compressed else open
    data = bytearray()  # grown in place: no second full-size copy from joining chunks
    try:
        with opener(job.path, "rb") as f:
            while chunk := f.read(8 << 20):
                if len(data) + len(chunk) > job.max_bytes:
                    raise _Reject(Exclusion.UNREADABLE, f"trace decompresses to more than {job.max_bytes} bytes")
                data += chunk
    except (gzip.BadGzipFile, EOFError, OSError) as exc:
        raise _Reject(Exclusion.UNREADABLE, f"corrupt gzip stream: {exc}") from exc
    return data, compressed


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _facts(data: bytearray, compressed: bool) -> TraceFacts:
    try:
        doc = limits.loads(data, limits.TRACE_FILE)
    except (UnicodeDecodeError, ValueError) as exc:  # JsonLimitError included
        raise _Reject(Exclusion.UNREADABLE, f"not JSON: {str(exc)[:200]}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise _Reject(Exclusion.UNREADABLE, "not a Kineto trace: no top-level traceEvents array")
    events = doc["traceEvents"]
    complete = cpu_ops = annotations = kernels = gpu = comm = legacy = steps = 0
    ts_min, ts_max = float("inf"), float("-inf")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur, cat, name = e.get("ts"), e.get("dur"), e.get("cat"), e.get("name")
        if not (_num(ts) and _num(dur) and isinstance(cat, str) and isinstance(name, str)
                and "pid" in e and "tid" in e):
            continue
        complete += 1
        ts_min, ts_max = min(ts_min, ts), max(ts_max, ts + dur)
        if cat == "cpu_op":
            cpu_ops += 1
        elif cat == "user_annotation":
            annotations += 1
        elif cat == "kernel":
            kernels += 1
            if _COMM_KERNEL.match(name):
                comm += 1
                legacy += name.startswith("ncclKernel")
        if name.startswith("ProfilerStep#"):
            steps += 1
        args = e.get("args")
        if isinstance(args, dict):
            stream, corr = args.get("stream"), args.get("correlation")
            if _num(stream) and _num(corr) and stream >= 0 and corr >= 0:
                gpu += 1
    if complete == 0:
        raise _Reject(Exclusion.UNREADABLE, "no complete events (ph X with ts, dur, cat, name, pid, tid): "
                                            "nothing for HTA to analyse")
    dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    rank, world = _int_or_none(dist.get("rank")), _int_or_none(dist.get("world_size"))
    return TraceFacts(
        events=len(events), complete_events=complete, cpu_ops=cpu_ops, user_annotations=annotations,
        kernels=kernels, gpu_events=gpu, comm_kernels=comm, nccl_legacy_kernels=legacy, profiler_steps=steps,
        ts_min_us=float(ts_min), ts_max_us=float(ts_max), base_time_ns=_int_or_none(doc.get("baseTimeNanoseconds")),
        distributed_rank=rank if rank is not None and rank >= 0 else None, world_size=world,
        compressed=compressed, rank_inserted=False)


def _hta_name(job: InspectJob, compressed: bool) -> Path:
    # HTA opens with gzip iff the name ends in "gz": the name must follow the content
    return Path(job.hta_dir) / f"rank-{job.rank}.json{'.gz' if compressed else ''}"


def _stage_for_hta(job: InspectJob, data: bytearray, facts: TraceFacts) -> Path | None:
    """Write a patched copy when distributedInfo is missing; None when the file can be used as is."""
    if facts.distributed_rank is not None:
        return None
    brace = data.index(b"{")  # the document is a JSON object, so its first token is "{"
    insert = b'"distributedInfo": {"rank": %d}, ' % job.rank
    dest = _hta_name(job, facts.compressed)
    view = memoryview(data)  # written in three pieces: no patched full-size copy in memory
    with (gzip.open(dest, "wb", compresslevel=1) if facts.compressed else open(dest, "wb")) as f:
        f.write(view[:brace + 1])
        f.write(insert)
        f.write(view[brace + 1:])
    return dest


def _link_or_copy(src: Path, job: InspectJob, compressed: bool) -> Path:
    dest = _hta_name(job, compressed)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest
