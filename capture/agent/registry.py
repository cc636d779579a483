"""Worker registry: the hook's registration records, each tied to a live host process (or not).

A record names the worker by its pid *inside its own pid namespace* (what Kineto reports to
dynolog). The agent needs the host pid to know whether the worker still lives, and ties the two
through `/proc/<host pid>/status` NSpid (whose last field is the pid in the innermost namespace)
plus `/proc/<host pid>/ns/pid` (which namespace). The record's `host_pid` is only a hint: inside a
container with its own /proc it is the container pid. A process that started after the record was
written is a pid reuse, never the worker. Records whose process is gone are removed after a grace
period, so a crashed trainer (no atexit) does not leave targets that look registered forever.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpulens.ground.logs import get_logger

from .. import schemas
from ..wire import limits
from ..models import RegistrationRecord
from .steps import StepLog, StepsUnreadable, read_steps

__all__ = ["Worker", "WorkerRegistry", "ProcFs"]

_log = get_logger("agent")


@dataclass(frozen=True)
class Worker:
    record: RegistrationRecord
    path: Path
    host_pid: int | None  # None: no live process matches the record

    @property
    def alive(self) -> bool:
        return self.host_pid is not None

    def to_dict(self) -> dict[str, Any]:
        """The wire shape of GET /v1/workers: the record, host_pid as resolved here, and alive."""
        d = self.record.to_dict()
        d.update(host_pid=self.host_pid, alive=self.alive)
        return d


class ProcFs:
    """Reads the few /proc facts the registry needs; `root` is injectable for tests."""

    def __init__(self, root: Path = Path("/proc")):
        self.root = Path(root)
        self._btime: float | None = None
        self._hz = os.sysconf("SC_CLK_TCK")

    def nspids(self, pid: int) -> list[int] | None:
        try:
            with open(self.root / str(pid) / "status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        return [int(x) for x in line.split()[1:]]
        except (OSError, ValueError):
            return None
        return None

    def pid_namespace(self, pid: int) -> str | None:
        try:
            return os.readlink(self.root / str(pid) / "ns" / "pid")
        except OSError:
            return None

    def start_time(self, pid: int) -> float | None:
        """Unix time the process started (boot time + starttime ticks)."""
        try:
            stat = (self.root / str(pid) / "stat").read_text()
            ticks = int(stat.rsplit(")", 1)[1].split()[19])
            if self._btime is None:
                for line in (self.root / "stat").read_text().splitlines():
                    if line.startswith("btime "):
                        self._btime = float(line.split()[1])
            return (self._btime or 0.0) + ticks / self._hz
        except (OSError, ValueError, IndexError):
            return None

    def pids(self) -> list[int]:
        try:
            return [int(n) for n in os.listdir(self.root) if n.isdigit()]
        except OSError:
            return []


class WorkerRegistry:
    def __init__(self, registry_dir: Path, *, proc: ProcFs | None = None, stale_grace_s: float = 120.0,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(registry_dir)
        self.proc = proc or ProcFs()
        self.stale_grace_s = stale_grace_s
        self._clock = clock
        self._bad_seen: set[tuple[str, float]] = set()

    # --- reading ---------------------------------------------------------------------------

    def records(self) -> list[tuple[Path, RegistrationRecord]]:
        """Every valid record; invalid files are logged once (by name and mtime) and skipped."""
        out = []
        try:
            entries = sorted(self.dir.iterdir())
        except OSError as exc:
            _log.warning("registry.unreadable", dir=str(self.dir), error=str(exc))
            return out
        for path in entries:
            if path.suffix != ".json" or path.name.startswith("."):
                continue  # the hook's temp files are dot-files
            try:
                data = limits.load_file(path, limits.REGISTRATION_FILE)
                out.append((path, RegistrationRecord.from_dict(data)))
            except (OSError, ValueError, schemas.SchemaError) as exc:
                key = (path.name, _mtime(path))
                if key not in self._bad_seen:
                    self._bad_seen.add(key)
                    field = getattr(exc, "field", None)
                    _log.warning("registry.bad_record", file=path.name, field=field, error=str(exc)[:300])
        return out

    def workers(self) -> list[Worker]:
        recs = self.records()
        table: dict[tuple[str, int], int] | None = None
        out = []
        for path, rec in recs:
            host = self._check(rec.host_pid, rec) if rec.host_pid else None
            if host is None:
                if table is None:
                    table = self._namespace_table()
                candidate = table.get((rec.pid_namespace, rec.pid))
                host = self._check(candidate, rec) if candidate else None
            out.append(Worker(rec, path, host))
        return out

    def find(self, job_id: str, attempt: int, rank: int, *, pod_uid: str | None = None,
             pod: str | None = None) -> Worker | None:
        """The worker with this identity, preferring a live one and then the newest record.

        A pod is told apart by its uid and, where either side lacks one (a process armed without
        the downward-API uid), by its name: two serving replicas on one node both say rank 0 of
        the same revision, and only the pod distinguishes them."""
        matches = [w for w in self.workers()
                   if w.record.job_id == job_id and w.record.attempt == attempt and w.record.global_rank == rank
                   and (w.record.pod_uid == pod_uid if pod_uid and w.record.pod_uid
                        else not pod or not w.record.pod or w.record.pod == pod)]
        if not matches:
            return None
        return max(matches, key=lambda w: (w.alive, w.record.start_time))

    def is_same_process(self, host_pid: int | None, pid: int | None, pid_namespace: str | None,
                        start_time: float | None) -> bool:
        """Is `host_pid` still the registered worker (cheap: no /proc scan)?"""
        if not host_pid or pid is None or pid_namespace is None or start_time is None:
            return False
        return self._matches(host_pid, pid, pid_namespace, start_time)

    def steps(self, steps_file: str | None) -> StepLog:
        """A worker's published step count (hooks/site/_gpulens_steps.py) from its record's
        `steps_file`; StepsUnreadable when there is none (an older hook, no torch optimizer) or the
        file is not one. The name must be a plain `*.steps` file in this folder: a record never
        points elsewhere."""
        name = steps_file or ""
        if not name or "/" in name or "\\" in name or name.startswith(".") or not name.endswith(".steps"):
            raise StepsUnreadable("no step count published" + (f" (bad file name {name!r})" if name else
                                  " (a hook without the step counter, or no torch optimizer)"))
        return read_steps(self.dir / name)

    # --- housekeeping ----------------------------------------------------------------------

    def remove_stale(self) -> list[Path]:
        """Delete records whose process is gone and whose file is older than the grace period."""
        removed = []
        now = self._clock()
        for w in self.workers():
            if w.alive or now - _mtime(w.path) < self.stale_grace_s:
                continue
            try:
                w.path.unlink()
                removed.append(w.path)
                if w.record.steps_file and "/" not in w.record.steps_file and w.record.steps_file.endswith(".steps"):
                    (self.dir / w.record.steps_file).unlink(missing_ok=True)   # a killed worker leaves its counter
                _log.info("registry.stale_removed", file=w.path.name, job_id=w.record.job_id, rank=w.record.global_rank,
                          pid=w.record.pid)
            except OSError as exc:
                _log.warning("registry.remove_failed", file=w.path.name, error=str(exc))
        return removed

    # --- pid namespace mapping -------------------------------------------------------------

    def _check(self, host_pid: int | None, rec: RegistrationRecord) -> int | None:
        if host_pid and self._matches(host_pid, rec.pid, rec.pid_namespace, rec.start_time):
            return host_pid
        return None

    def _matches(self, host_pid: int, pid: int, pid_namespace: str, start_time: float) -> bool:
        ns = self.proc.nspids(host_pid)
        if not ns or ns[-1] != pid or self.proc.pid_namespace(host_pid) != pid_namespace:
            return False
        started = self.proc.start_time(host_pid)
        return started is not None and started <= start_time + 2.0  # later: a reused pid, not the worker

    def _namespace_table(self) -> dict[tuple[str, int], int]:
        """(pid namespace, pid inside it) -> host pid, for every visible process."""
        table = {}
        for pid in self.proc.pids():
            ns = self.proc.nspids(pid)
            pidns = self.proc.pid_namespace(pid) if ns else None
            if ns and pidns:
                table[(pidns, ns[-1])] = pid
        return table


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def agent_view(theirs: str, mine: Path | None, host_pid: int | None) -> Path:
    """The trainer's folder `theirs` as this agent reaches it: the agent's own `mine` when they are
    the same folder (a shared hostPath), else through the trainer's root (/proc/<pid>/root)."""
    via_proc = Path(f"/proc/{host_pid}/root") / theirs.lstrip("/")
    if mine is not None:
        for candidate in (Path(theirs), via_proc):
            try:
                if os.path.samefile(candidate, mine):
                    return Path(mine)
            except OSError:
                continue
    return Path(theirs) if host_pid is None else via_proc
