"""Pod identity from the trainer hook's registration records, for nodes without Kubernetes.

Records are `capture/schemas/registration.schema.json` documents, one JSON file per worker in
--registry-dir. The exporter reads only the fields it needs, straight from the JSON (exporter and
capture are independent packages). A record matches a host process by (pid namespace, pid inside
it), which is what the hook can see, or by host_pid within the same pid namespace; a record
written before the process started belongs to an earlier process with a recycled pid.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .procfs import ProcFS

__all__ = ["Registration", "RegistrationIndex"]

# a record may be written a little before /proc's start time rounds up; a process can't be younger
_START_SLACK_S = 2.0


@dataclass(frozen=True)
class Registration:
    namespace: str
    pod: str
    container: str
    pod_uid: str
    pid: int
    host_pid: int | None
    pid_namespace: str
    start_time: float
    path: str
    job_id: str = ""           # GPULENS_JOB_ID of the worker: the series' gpulens_job label
    local_rank: int | None = None   # the worker's LOCAL_RANK: the series' rank label
    workload: str = ""         # the record's "<Kind>/<name>" (GPULENS_WORKLOAD): the series' gpulens_workload


#: what a record's workload may say: a kind and a name, as the pod index's workload_of_pod gives them
_WORKLOAD = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}/[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def _workload(value: object) -> str:
    """The record's workload when it is a bounded `<Kind>/<name>`, else "" (job/<job id> then)."""
    return value if isinstance(value, str) and _WORKLOAD.fullmatch(value) else ""


def _record(data: object, path: str) -> Registration | None:
    if not isinstance(data, dict):
        return None
    try:
        ns, pod, pid, pidns = data["namespace"], data["pod"], data["pid"], data["pid_namespace"]
    except KeyError:
        return None
    host_pid, start = data.get("host_pid"), data.get("start_time", 0)
    if not (isinstance(ns, str) and ns and isinstance(pod, str) and pod and isinstance(pidns, str)):
        return None
    if not (isinstance(pid, int) and pid > 0) or isinstance(pid, bool):
        return None
    if host_pid is not None and not (isinstance(host_pid, int) and host_pid > 0):
        return None
    if not isinstance(start, (int, float)):
        return None
    container, uid, job = data.get("container", ""), data.get("pod_uid", ""), data.get("job_id", "")
    local_rank = data.get("local_rank")
    if not isinstance(local_rank, int) or isinstance(local_rank, bool) or local_rank < 0:
        local_rank = None
    return Registration(namespace=ns, pod=pod, container=container if isinstance(container, str) else "",
                        pod_uid=uid if isinstance(uid, str) else "", pid=pid, host_pid=host_pid,
                        pid_namespace=pidns, start_time=float(start), path=path,
                        job_id=job if isinstance(job, str) else "", local_rank=local_rank,
                        workload=_workload(data.get("workload")))


class RegistrationIndex:
    def __init__(self, directory: str | Path, proc: ProcFS):
        self.directory = Path(directory)
        self._proc = proc
        self._cache: dict[str, tuple[float, int, Registration | None]] = {}
        self._by_nspid: dict[tuple[str, int], list[Registration]] = {}
        self._by_host: dict[int, list[Registration]] = {}
        self.invalid: set[str] = set()     # files that are not readable records (names, for logs)
        self.errors = 0                    # how many times a file failed to parse
        self.last_error: str | None = None

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_nspid.values())

    def refresh(self) -> None:
        """Re-read changed files (by mtime and size) and drop removed ones."""
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(".json")]
        except FileNotFoundError:
            names = []
        except OSError as exc:
            self.errors += 1
            self.last_error = f"{self.directory}: {exc}"
            return
        seen = set()
        for name in names:
            path = str(self.directory / name)
            seen.add(path)
            try:
                st = os.stat(path)
            except OSError:
                continue
            cached = self._cache.get(path)
            if cached and cached[0] == st.st_mtime and cached[1] == st.st_size:
                continue
            error = "not a registration record"
            try:
                with open(path, "rb") as f:
                    rec = _record(json.loads(f.read(1 << 20)), path)
            except (OSError, ValueError) as exc:
                rec, error = None, str(exc)
            if rec is None:                   # counted once per version of the file
                self.errors += 1
                self.last_error = f"{path}: {error}"
                self.invalid.add(path)
            else:
                self.invalid.discard(path)
            self._cache[path] = (st.st_mtime, st.st_size, rec)
        for path in list(self._cache):
            if path not in seen:
                del self._cache[path]
                self.invalid.discard(path)
        by_nspid: dict[tuple[str, int], list[Registration]] = {}
        by_host: dict[int, list[Registration]] = {}
        for _m, _s, rec in self._cache.values():
            if rec is None:
                continue
            by_nspid.setdefault((rec.pid_namespace, rec.pid), []).append(rec)
            if rec.host_pid:
                by_host.setdefault(rec.host_pid, []).append(rec)
        self._by_nspid, self._by_host = by_nspid, by_host

    def match(self, pid: int) -> Registration | None:
        """The record written by host process `pid`, if any."""
        pidns = self._proc.pid_namespace(pid)
        nspids = self._proc.ns_pids(pid)
        if pidns is None:
            return None
        candidates = list(self._by_nspid.get((pidns, nspids[-1]), [])) if nspids else []
        candidates += [r for r in self._by_host.get(pid, []) if r.pid_namespace == pidns]
        if not candidates:
            return None
        started = self._proc.start_unix(pid)
        fresh = [r for r in candidates if started is None or r.start_time + _START_SLACK_S >= started]
        return max(fresh, key=lambda r: r.start_time) if fresh else None
