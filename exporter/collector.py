"""The Prometheus collector: fresh families from a snapshot of every source, at each scrape.

Nothing here is mutated per event: the BPF maps do the counting, the sources keep their own
state, and `collect()` turns one `ScrapeData` into families (client_python's custom-collector
recipe). The function that gathers the data is injected, which keeps this module pure and lets
tests feed it hand-made snapshots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .catalogue import Catalogue
from .ledger import SeriesKey, Totals
from .probes import MapUsage

__all__ = ["SourceView", "ScrapeData", "GpulensCollector", "build_families"]


@dataclass(frozen=True)
class SourceView:
    name: str
    up: bool
    state: str
    reason: str
    errors: int


@dataclass
class ScrapeData:
    node: str
    sources: list[SourceView] = field(default_factory=list)
    workload_totals: dict[SeriesKey, Totals] | None = None      # None: eBPF off
    back_pressure: bool = True       # False: return probes unsafe here, blocked time is not measured
    gpu_pods: dict[str, int] = field(default_factory=dict)       # gpu -> distinct pods
    gpu_processes: dict[str, int] = field(default_factory=dict)  # gpu -> processes
    gpu_memory: dict[SeriesKey, float] = field(default_factory=dict)
    gpu_util: dict[SeriesKey, float] = field(default_factory=dict)
    gpu_owner: dict[str, tuple[str, str, str, str]] = field(default_factory=dict)   # gpu -> (namespace, pod, job, workload) if one pod
    dcgm_gauges: dict[tuple[str, str], float] = field(default_factory=dict)
    dcgm_pcie: dict[tuple[str, str], float] = field(default_factory=dict)
    probes_attached: int = 0
    libraries_attached: int = 0
    attach_errors: int = 0
    tracked_processes: int = 0
    maps: list[MapUsage] = field(default_factory=list)


_COUNTERS = [
    ("gpulens_kernel_launches_total", "launches"),
    ("gpulens_graph_launches_total", "graph_launches"),
    ("gpulens_graph_kernels_total", "graph_kernels"),
    ("gpulens_graph_unknown_launches_total", "graph_unknown"),
]
# measured by return probes: absent (not 0) where the safety gate turned them off
_BACK_PRESSURE = [
    ("gpulens_sync_wait_seconds_total", "sync_seconds"),
    ("gpulens_sync_calls_total", "sync_calls"),
]


def build_families(d: ScrapeData, cat: Catalogue, previous_duration: float | None) -> list:
    node = d.node
    out = []

    def fam(name):
        f = cat.family(name)
        out.append(f)
        return f

    if d.workload_totals is not None:
        series = sorted(d.workload_totals.items())
        for name, attr in _COUNTERS + (_BACK_PRESSURE if d.back_pressure else []):
            f = fam(name)
            for k, t in series:
                f.add([node, k.gpu, k.namespace, k.pod, k.container, k.job, k.workload, k.rank], getattr(t, attr))
        nbytes, calls = fam("gpulens_memcpy_bytes_total"), fam("gpulens_memcpy_calls_total")
        for k, t in series:
            base = [node, k.gpu, k.namespace, k.pod, k.container, k.job, k.workload, k.rank]
            nbytes.add(base + ["h2d"], t.h2d_bytes)
            nbytes.add(base + ["d2h"], t.d2h_bytes)
            calls.add(base + ["h2d"], t.h2d_calls)
            calls.add(base + ["d2h"], t.d2h_calls)

    if d.gpu_processes or d.gpu_pods:
        pods, procs = fam("gpulens_gpu_pods"), fam("gpulens_gpu_processes")
        for gpu in sorted(d.gpu_processes):
            pods.add([node, gpu], d.gpu_pods.get(gpu, 0))
            procs.add([node, gpu], d.gpu_processes[gpu])
        mem, util = fam("gpulens_process_gpu_memory_bytes"), fam("gpulens_process_gpu_utilization_ratio")
        for k, v in sorted(d.gpu_memory.items()):
            mem.add([node, k.gpu, k.namespace, k.pod, k.container, k.job, k.workload, k.rank], v)
        for k, v in sorted(d.gpu_util.items()):
            util.add([node, k.gpu, k.namespace, k.pod, k.container, k.job, k.workload, k.rank], v)

    if d.dcgm_gauges or d.dcgm_pcie:
        by_metric: dict[str, list[tuple[str, float]]] = {}
        for (metric, gpu), v in sorted(d.dcgm_gauges.items()):
            by_metric.setdefault(metric, []).append((gpu, v))
        for metric, values in by_metric.items():
            f = fam(metric)
            for gpu, v in values:
                ns, pod, job, workload = d.gpu_owner.get(gpu, ("", "", "", ""))
                f.add([node, gpu, ns, pod, job, workload], v)
        if d.dcgm_pcie:
            f = fam("gpulens_dcgm_pcie_bytes_total")
            for (gpu, direction), v in sorted(d.dcgm_pcie.items()):
                ns, pod, job, workload = d.gpu_owner.get(gpu, ("", "", "", ""))
                f.add([node, gpu, ns, pod, job, workload, direction], v)

    up, info, errors = fam("gpulens_exporter_source_up"), fam("gpulens_exporter_source_info"), \
        fam("gpulens_exporter_source_errors_total")
    for s in d.sources:
        up.add([node, s.name], 1 if s.up else 0)
        info.add([node, s.name, s.state, s.reason], 1)
        errors.add([node, s.name], s.errors)
    fam("gpulens_exporter_probes_attached").add([node], d.probes_attached)
    fam("gpulens_exporter_libraries_attached").add([node], d.libraries_attached)
    fam("gpulens_exporter_probe_attach_errors_total").add([node], d.attach_errors)
    fam("gpulens_exporter_tracked_processes").add([node], d.tracked_processes)
    if d.maps:
        entries, cap = fam("gpulens_exporter_map_entries"), fam("gpulens_exporter_map_capacity")
        fails = fam("gpulens_exporter_map_update_failures_total")
        for m in d.maps:
            entries.add([node, m.name], m.entries)
            cap.add([node, m.name], m.capacity)
            fails.add([node, m.name], m.update_failures)
    if previous_duration is not None:
        fam("gpulens_exporter_scrape_duration_seconds").add([node], previous_duration)
    return [f.family for f in out]


class GpulensCollector:
    """prometheus_client collector; `gather` returns the current ScrapeData (it may block)."""

    def __init__(self, gather: Callable[[], ScrapeData], catalogue: Catalogue,
                 clock: Callable[[], float] = time.perf_counter):
        self._gather = gather
        self._catalogue = catalogue
        self._clock = clock
        self.last_duration: float | None = None

    def collect(self) -> Iterator:
        start = self._clock()
        families = build_families(self._gather(), self._catalogue, self.last_duration)
        self.last_duration = self._clock() - start
        yield from families
