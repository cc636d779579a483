"""Which workload a host process belongs to: Kubernetes pod, registration record, or local.

Order: the cgroup names a pod UID that this node's pod index knows -> that pod (and the container
whose ID the cgroup names, and the job the pod's labels name); else a registration record written
by the process (embedded mode, no Kubernetes) -> its namespace/pod/container and job_id; else
namespace "local", the process name as pod and no job. The workload (label gpulens_workload) is
the pod's owning workload in Kubernetes, else the record's own (`gpulens up`'s serving demo names
its Deployment), else job/<job_id>, else the pod itself (workload_id).
While a cgroup names a pod the index has not seen yet (watch lag), the answer is "not yet"
(None) so that labels are not pinned to a fallback that is about to change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cgroups import parse_cgroup
from .kube import PodIndex
from .procfs import ProcFS
from .registrations import RegistrationIndex

__all__ = ["Workload", "Attributor", "local_workload", "workload_id", "rank_label", "MAX_RANK"]


@dataclass(frozen=True, order=True)
class Workload:
    namespace: str
    pod: str
    container: str
    source: str = "local"      # kubernetes | registration | local
    job: str = ""              # job id (label gpulens_job); "" when neither the pod nor a record names one
    workload: str = ""         # label gpulens_workload; "" = the pod itself (see workload_id)
    rank: str = ""             # label rank: the worker's local rank (rank_label), "" when it has none


#: a rank label is a small integer: torchrun's LOCAL_RANK is below the workers per node
MAX_RANK = 1024


def rank_label(value: object) -> str:
    """The `rank` label for a LOCAL_RANK value: its decimal form when it is an integer in
    [0, MAX_RANK), else "" (anything else would let a process choose unbounded label values)."""
    if isinstance(value, bool):
        return ""
    if isinstance(value, str):
        value = value.strip()
        if not value.isascii() or not value.isdigit() or len(value) > 4:
            return ""
        value = int(value)
    return str(value) if isinstance(value, int) and 0 <= value < MAX_RANK else ""


def workload_id(w: Workload) -> str:
    """The gpulens_workload label: the pod's workload (kube.workload_of_pod), job/<job id> for a
    registration record that names a job, else Pod/<pod> (an unowned pod is its own workload)."""
    if w.workload:
        return w.workload
    return f"job/{w.job}" if w.job else f"Pod/{w.pod}"


def local_workload(process_name: str | None) -> Workload:
    return Workload("local", process_name or "unknown", "", "local")


class Attributor:
    def __init__(self, proc: ProcFS, *, pods: PodIndex | None = None,
                 registrations: RegistrationIndex | None = None, cache_size: int = 65536):
        self._proc = proc
        self.pods = pods
        self.registrations = registrations
        self._cache: dict[tuple[int, int], Workload] = {}
        self._cache_size = cache_size

    def attribute(self, pid: int) -> Workload | None:
        """The workload of a live process, or None while it cannot be settled yet (or it is gone)."""
        start = self._proc.start_ticks(pid)
        if start is None:
            return None
        cached = self._cache.get((pid, start))
        if cached is not None:
            return cached
        text = self._proc.cgroup(pid)
        if text is None:
            return None
        ident = parse_cgroup(text)
        workload: Workload | None = None
        pending = False
        if ident.pod_uid and self.pods is not None:
            info = self.pods.get(ident.pod_uid)
            if info is not None:
                container = info.containers.get(ident.container_id or "", "")
                workload = Workload(info.namespace, info.name, container, "kubernetes", info.job, info.workload)
            else:
                pending = True
        # the worker's local rank: torchrun's LOCAL_RANK in its environment, else its record's
        rank = rank_label(self._proc.environ(pid, "LOCAL_RANK"))
        rec = self.registrations.match(pid) if self.registrations is not None and (
            workload is None or not rank) else None
        if workload is None and rec is not None:
            workload = Workload(rec.namespace, rec.pod, rec.container, "registration", rec.job_id, rec.workload)
        if workload is None:
            if pending:
                return None
            comm = self._proc.comm(pid)
            if comm is None:
                return None
            workload = local_workload(comm)
        if not rank and rec is not None and rec.local_rank is not None:
            rank = rank_label(rec.local_rank)
        if rank:
            workload = replace(workload, rank=rank)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[(pid, start)] = workload
        return workload

    def forget(self, pid: int) -> None:
        for key in [k for k in self._cache if k[0] == pid]:
            del self._cache[key]

    def prune(self, live_pids: set[int]) -> None:
        for key in [k for k in self._cache if k[0] not in live_pids]:
            del self._cache[key]
