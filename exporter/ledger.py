"""Per-process BPF counters -> monotonic per-workload counter series.

Prometheus series are per (gpu, namespace, pod, container, job, workload); the BPF map is per process. Two rules
keep the series monotonic, which `rate()` depends on:

- a process's labels are pinned once, when it is settled (its workload known and, with NVML, its
  GPU known; or a grace period passed), so its counts never move between series;
- when a process exits, its final counts are folded into a per-series "retired" total before its
  map entry is deleted, so the series does not drop. Retired totals of series with no live process
  are forgotten after `retired_ttl` (the series then ends, as a series of a deleted pod should).

Counts of a process that is not yet settled are held back (they stay in the map) and appear in
full once it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable

from .attribution import Workload, local_workload, workload_id
from .probes import ProcessCounters, ProcessKey

__all__ = ["SeriesKey", "Totals", "ProcessLedger"]


@dataclass(frozen=True, order=True)
class SeriesKey:
    gpu: str
    namespace: str
    pod: str
    container: str
    job: str = ""              # label gpulens_job
    # label gpulens_workload (attribution.workload_id): a function of the pod, so not part of the identity
    workload: str = field(default="", compare=False)
    rank: str = ""             # label rank: the worker's local rank, "" for a process without one


@dataclass
class Totals:
    launches: int = 0
    graph_launches: int = 0
    graph_kernels: int = 0
    graph_unknown: int = 0
    sync_calls: int = 0
    sync_seconds: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_calls: int = 0
    d2h_calls: int = 0

    def add(self, other: "Totals | ProcessCounters") -> None:
        for f in fields(Totals):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class _Proc:
    first_seen: float
    series: SeriesKey | None = None
    last: ProcessCounters | None = None


@dataclass
class _Retired:
    totals: Totals = field(default_factory=Totals)
    updated: float = 0.0


def _field_max(a: ProcessCounters, b: ProcessCounters) -> ProcessCounters:
    from dataclasses import replace
    return replace(a, **{f.name: max(getattr(a, f.name), getattr(b, f.name)) for f in fields(Totals)})


class ProcessLedger:
    def __init__(self, *, grace_s: float = 10.0, retired_ttl_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic):
        self._grace = grace_s
        self._ttl = retired_ttl_s
        self._clock = clock
        self._procs: dict[ProcessKey, _Proc] = {}
        self._retired: dict[SeriesKey, _Retired] = {}
        self._by_cgroup: dict[int, Workload] = {}
        self.exited_total = 0

    def update(self, counters: Iterable[ProcessCounters], *, alive: Callable[[ProcessKey], bool] | None,
               workload_of: Callable[[int], Workload | None], gpu_of: Callable[[int], str | None],
               gpu_required: bool,
               reread: Callable[[ProcessKey], ProcessCounters | None] | None = None) -> list[ProcessKey]:
        """Take a fresh read of the map; returns keys of exited processes (already folded) to delete.

        With `alive=None` (a scrape) only the counts are refreshed: exits, label settling and
        expiry wait for the next full update (the discovery tick), so a scrape never reads /proc
        per process and never attributes a pid it has not checked. `reread` fetches an exited
        process's entry again after its death was seen, so calls it made between the map read and
        its exit are not lost.
        """
        now = self._clock()
        if alive is None:
            for c in counters:
                proc = self._procs.get(c.key)
                if proc is not None:
                    proc.last = c
            return []
        seen: set[ProcessKey] = set()
        exited: list[ProcessKey] = []
        for c in counters:
            seen.add(c.key)
            proc = self._procs.setdefault(c.key, _Proc(first_seen=now))
            proc.last = c
            is_alive = alive(c.key)
            if proc.series is None:
                proc.series = self._settle(c, proc, now, is_alive, workload_of, gpu_of, gpu_required)
            if not is_alive:
                final = reread(c.key) if reread is not None else None
                if final is not None:   # counters only grow; open-call time may exceed the final read
                    proc.last = _field_max(c, final)
                self._retire(proc, now)
                exited.append(c.key)
                del self._procs[c.key]
        for key in [k for k in self._procs if k not in seen]:   # deleted from the map elsewhere
            self._retire(self._procs.pop(key), now)
        live_series = {p.series for p in self._procs.values() if p.series is not None}
        for series in [s for s, r in self._retired.items() if s not in live_series and now - r.updated > self._ttl]:
            del self._retired[series]
        self.exited_total += len(exited)
        return exited

    def _settle(self, c: ProcessCounters, proc: _Proc, now: float, is_alive: bool,
                workload_of, gpu_of, gpu_required: bool) -> SeriesKey | None:
        late = not is_alive or now - proc.first_seen >= self._grace
        workload = workload_of(c.key.tgid) if is_alive else None
        gpu = gpu_of(c.key.tgid) if is_alive else None
        if workload is not None and c.cgroup_id:
            self._by_cgroup[c.cgroup_id] = workload
            if len(self._by_cgroup) > 65536:
                self._by_cgroup.clear()
        if not late and (workload is None or (gpu_required and gpu is None)):
            return None
        if workload is None:   # exited before we could look, or never resolvable: best effort
            workload = self._by_cgroup.get(c.cgroup_id) if c.cgroup_id > 1 else None
            # a neighbour's pod, but not its rank: this process's own is unknown
            workload = replace(workload, rank="") if workload else local_workload(c.comm)
        return SeriesKey(gpu or "unknown", workload.namespace, workload.pod, workload.container, workload.job,
                         workload_id(workload), rank=workload.rank)

    def _retire(self, proc: _Proc, now: float) -> None:
        if proc.series is None or proc.last is None:
            return
        retired = self._retired.setdefault(proc.series, _Retired())
        retired.totals.add(proc.last)
        retired.updated = now

    def totals(self) -> dict[SeriesKey, Totals]:
        out: dict[SeriesKey, Totals] = {}
        for series, retired in self._retired.items():
            out.setdefault(series, Totals()).add(retired.totals)
        for proc in self._procs.values():
            if proc.series is not None and proc.last is not None:
                out.setdefault(proc.series, Totals()).add(proc.last)
        return out

    @property
    def tracked(self) -> int:
        return len(self._procs)

    @property
    def pending(self) -> int:
        return sum(1 for p in self._procs.values() if p.series is None)

    def series_of(self, key: ProcessKey) -> SeriesKey | None:
        proc = self._procs.get(key)
        return proc.series if proc else None
