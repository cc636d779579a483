"""The exporter process: sources wired together, a periodic discovery tick, and the scrape.

Two paths touch shared state, the tick (every --scan-interval: find library files, attach or
detach probes, fold exited processes, refresh registrations) and the scrape (read the maps and
NVML, build families). Both run in worker threads, one at a time under one lock, so the event
loop that serves HTTP never blocks on /proc or bpf() syscalls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry

from gpulens.ground.logs import get_logger

from .attribution import Attributor, Workload, local_workload, workload_id
from .catalogue import load_catalogue
from .collector import GpulensCollector, ScrapeData, SourceView
from .config import ExporterConfig
from .dcgm import DcgmSource
from .dcgm_discovery import DcgmFinder
from .discovery import LibraryScanner
from .exposition import ExpositionCache
from .health import FAILING, OK, WAITING, SourceHealth
from .kube import PodIndex, make_api_client
from .ledger import ProcessLedger, SeriesKey
from .nvml import NvmlApi, NvmlSnapshot, NvmlSource, open_nvml
from .probes import DriverProbes, ProbeUnavailable
from .retprobe_gate import GateVerdict, self_test
from .procfs import ProcFS
from .registrations import RegistrationIndex

__all__ = ["Exporter"]

log = get_logger("exporter")
_DEFAULT = object()
_ATTACH_RETRY_S = 30.0


class Exporter:
    def __init__(self, config: ExporterConfig, *, nvml_opener: Callable[[], NvmlApi] | None | object = _DEFAULT,
                 pod_index: PodIndex | None | object = _DEFAULT,
                 dcgm_finder: DcgmFinder | None | object = _DEFAULT,
                 probes_factory: Callable[[], DriverProbes] | None = None,
                 return_probe_gate: Callable[[DriverProbes], GateVerdict] = self_test,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.proc = ProcFS(config.proc_root)
        self.health = {name: SourceHealth(name) for name in ("ebpf", "return_probes", "nvml", "dcgm")}
        self._lock = threading.Lock()
        self.catalogue = load_catalogue()
        self.collector = GpulensCollector(self.scrape_data, self.catalogue)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        #: what /metrics serves: the collector's families, encoded at the tick (exposition.py)
        self.exposition = ExpositionCache(self.collector.collect, tick_interval_s=config.scan_interval_s)
        self.scanner = LibraryScanner(self.proc, config.library_globs, rescan_interval=config.rescan_interval_s,
                                      clock=clock)
        self.ledger = ProcessLedger(grace_s=config.attribution_grace_s, retired_ttl_s=config.retired_ttl_s,
                                    clock=clock)
        self.registrations = RegistrationIndex(config.registry_dir, self.proc) if config.registry_dir else None
        if pod_index is _DEFAULT:
            pod_index = (PodIndex(lambda: make_api_client(config.kubeconfig), config.node)
                         if config.kubernetes else None)
        self.pods: PodIndex | None = pod_index  # type: ignore[assignment]
        self.attributor = Attributor(self.proc, pods=self.pods, registrations=self.registrations)
        if nvml_opener is _DEFAULT:
            nvml_opener = open_nvml(config.nvml, proc_root=str(config.proc_root))
        self._nvml_opener = nvml_opener
        self.nvml: NvmlSource | None = None
        if dcgm_finder is _DEFAULT:
            dcgm_finder = (DcgmFinder(lambda: make_api_client(config.kubeconfig), config.node,
                                      namespaces=config.dcgm_namespaces)
                           if config.dcgm_discovery and not config.dcgm_url else None)
        self.dcgm_finder: DcgmFinder | None = dcgm_finder  # type: ignore[assignment]
        self.dcgm: DcgmSource | None = None
        if config.dcgm_url:
            self.dcgm = DcgmSource(config.dcgm_url, self.health["dcgm"], interval_s=config.dcgm_interval_s)
        elif self.dcgm_finder is not None:
            self.dcgm = DcgmSource(None, self.health["dcgm"], interval_s=config.dcgm_interval_s,
                                   locate=self.dcgm_finder.find)
        else:
            self.health["dcgm"].disabled(config.dcgm_discovery_off)
        self._probes_factory = probes_factory or (lambda: DriverProbes(
            max_processes=config.max_processes, max_inflight=config.max_inflight))
        self.probes: DriverProbes | None = None
        self._return_probe_gate = return_probe_gate
        #: the safety gate's decision on this kernel (None: eBPF off, no decision needed)
        self.gate: GateVerdict | None = None
        self.attach_errors = 0
        self._attach_failed: dict[tuple[int, int], float] = {}   # library -> when attaching failed
        self._clock = clock
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Blocking start-up (compiles the BPF program, opens NVML, starts the pod watch)."""
        if self._started:
            return
        self._started = True
        self.nvml = NvmlSource(self._nvml_opener, self.health["nvml"])  # type: ignore[arg-type]
        ebpf = self.health["ebpf"]
        if not self.config.ebpf:
            ebpf.disabled("eBPF disabled (--no-ebpf)")
            self.health["return_probes"].disabled("eBPF off")
        else:
            try:
                self.probes = self._probes_factory()
            except ProbeUnavailable as exc:
                ebpf.disabled(str(exc))
                self.health["return_probes"].disabled("eBPF off")
                log.warning("ebpf.unavailable", reason=str(exc))
            else:
                ebpf.waiting(self._no_library_reason())
                headers = getattr(self.probes, "kernel_headers", None)   # probe doubles have none
                if headers is not None:
                    log.info("ebpf.kernel_headers", headers=headers.describe())
                self._gate_return_probes()
                if self.probes.start_time_problem:
                    log.warning("ebpf.no_start_times", reason=self.probes.start_time_problem)
        if self.pods is not None:
            self.pods.start()
        if self.dcgm_finder is not None:
            self.dcgm_finder.start()
        log.info("exporter.started", node=self.config.node, ebpf=ebpf.view()[0],
                 nvml=self.health["nvml"].view()[0], dcgm=self.health["dcgm"].view()[0])

    def _gate_return_probes(self) -> None:
        """Decide, before any probe is placed, whether return probes may be (retprobe_gate.py)."""
        assert self.probes is not None
        try:
            self.gate = self._return_probe_gate(self.probes)
        except Exception as exc:   # a broken self-test must not put return probes on the workload
            self.gate = GateVerdict(False, f"self-test failed to run: {exc}", "")
        self.probes.return_probes = self.gate.safe
        h = self.health["return_probes"]
        if self.gate.safe:
            h.ok(self.gate.reason)
            log.info("return_probes.safe", kernel=self.gate.kernel, reason=self.gate.reason)
        else:
            h.disabled(self.gate.reason)
            log.warning("return_probes.unsafe", kernel=self.gate.kernel, reason=self.gate.reason)

    def close(self) -> None:
        if self.dcgm_finder is not None:
            self.dcgm_finder.request_stop()
        if self.pods is not None:
            self.pods.stop()
        if self.dcgm_finder is not None:
            self.dcgm_finder.stop()
        with self._lock:
            if self.probes is not None:
                self.probes.close()
                self.probes = None
            if self.nvml is not None:
                self.nvml.close()

    def _no_library_reason(self) -> str:
        return "no process maps a driver library matching " + " ".join(self.config.library_globs)

    # ---- the tick ----------------------------------------------------------------------------

    def tick(self) -> None:
        with self._lock, self.proc.snapshot():
            if self.registrations is not None:
                self.registrations.refresh()
            nv = self.nvml.snapshot() if self.nvml else NvmlSnapshot()
            if self.probes is not None:
                self._discover()
                self._sync_ledger(nv)
                self.probes.prune_inflight(self.proc.thread_alive)
            self.attributor.prune(set(self.proc.pids()))
        self.exposition.refresh()      # outside the lock: collecting takes it

    def _discover(self) -> None:
        assert self.probes is not None
        scan = self.scanner.scan()
        now = self._clock()
        for key, lib in scan.libraries.items():
            if key in self.probes.libraries or now - self._attach_failed.get(key, -1e9) < _ATTACH_RETRY_S:
                continue
            result = self.probes.attach(key, lib.attach_path)
            for err in result.errors:
                log.warning("library.attach_error", path=lib.path, error=err)
            self.attach_errors += len(result.errors)
            if result.attached:
                self._attach_failed.pop(key, None)
                log.info("library.attached", path=lib.path, via=lib.attach_path, probes=result.attached,
                         users=len(scan.users.get(key, ())))
            else:
                # Retry later, through a path re-resolved from whichever process maps it then (the
                # one we went through may have exited); not every tick, for a file that exports nothing.
                self._attach_failed[key] = now
                self.scanner.forget_file(key)
        for key in self.probes.libraries - set(scan.libraries):
            n = self.probes.detach(key)
            log.info("library.detached", dev=key[0], inode=key[1], probes=n, reason="no process maps it")
        self._attach_failed = {k: t for k, t in self._attach_failed.items() if k in scan.libraries}
        n = len(self.probes.libraries)
        if n:
            self.health["ebpf"].ok(f"probing {n} driver librar{'y' if n == 1 else 'ies'}")
        elif self._attach_failed:
            self.health["ebpf"].failing(f"{len(self._attach_failed)} driver libraries found, none could be probed",
                                        count=False)
        else:
            self.health["ebpf"].waiting(self._no_library_reason())

    def _sync_ledger(self, nv: NvmlSnapshot, check_exits: bool = True) -> None:
        """Fold a fresh map read into the ledger. Only the tick looks for exits and settles new
        processes; a scrape just refreshes counts (see ProcessLedger.update)."""
        assert self.probes is not None
        try:
            counters = self.probes.read()
        except Exception as exc:   # a map read failing must not take the scrape down
            self.health["ebpf"].failing(f"reading BPF maps: {exc}")
            return
        exited = self.ledger.update(
            counters, alive=(lambda k: self.proc.same_process(k.tgid, k.start_ns)) if check_exits else None,
            workload_of=self.attributor.attribute, gpu_of=nv.gpu_label,
            gpu_required=self.nvml is not None and self.nvml.enabled, reread=self.probes.read_one)
        if exited:
            self.probes.forget(exited)

    # ---- the scrape --------------------------------------------------------------------------

    def scrape_data(self) -> ScrapeData:
        with self._lock:
            nv = self.nvml.snapshot() if self.nvml else NvmlSnapshot()
            data = ScrapeData(node=self.config.node)
            if self.probes is not None:
                self._sync_ledger(nv, check_exits=False)
                data.workload_totals = self.ledger.totals()
                data.back_pressure = self.probes.return_probes
                data.probes_attached = self.probes.probes_attached
                data.libraries_attached = len(self.probes.libraries)
                data.tracked_processes = self.ledger.tracked
                try:
                    data.maps = self.probes.map_usage()
                except Exception as exc:
                    self.health["ebpf"].failing(f"reading BPF map sizes: {exc}")
            data.attach_errors = self.attach_errors
            self._contention(nv, data)
            if self.dcgm is not None:
                snap = self.dcgm.snapshot
                data.dcgm_gauges, data.dcgm_pcie = snap.gauges, snap.pcie_bytes
                self._dcgm_owners(snap.pods, data)
            data.sources = [self._view(h, self.dcgm_finder.errors if h.name == "dcgm" and self.dcgm_finder else 0)
                            for h in self.health.values()] + [self._attribution_view()]
            return data

    def _contention(self, nv: NvmlSnapshot, data: ScrapeData) -> None:
        for dev in nv.devices:
            gpu = str(dev.index)
            procs = nv.processes.get(dev.index, ())
            pods: dict[tuple[str, str] | tuple[str, int], tuple[str, str]] = {}   # pod -> (job, workload)
            for p in procs:
                w = self.attributor.attribute(p.pid) or local_workload(self.proc.comm(p.pid))
                pods[(w.namespace, w.pod) if w.pod != "unknown" else ("?", p.pid)] = (w.job, workload_id(w))
                key = SeriesKey(gpu, w.namespace, w.pod, w.container, w.job, workload_id(w), rank=w.rank)
                if p.used_memory_bytes is not None:
                    data.gpu_memory[key] = data.gpu_memory.get(key, 0.0) + p.used_memory_bytes
                u = nv.util.get((dev.index, p.pid))
                if u is not None:
                    data.gpu_util[key] = min(1.0, data.gpu_util.get(key, 0.0) + u)
            data.gpu_processes[gpu] = len(procs)
            data.gpu_pods[gpu] = len(pods)
            if len(pods) == 1:
                only, (job, workload) = next(iter(pods.items()))
                if only[0] != "?":
                    data.gpu_owner[gpu] = (str(only[0]), str(only[1]), job, workload)

    def _dcgm_owners(self, named: dict[str, tuple[str, str]], data: ScrapeData) -> None:
        """The pod dcgm-exporter names for a GPU (from the kubelet's pod-resources) owns it where
        NVML named none: no NVML here, or its one process not attributed. A GPU NVML sees shared
        keeps no owner. The pod's job and workload come from this node's pod index."""
        if not named:
            return
        infos = {(p.namespace, p.name): p for p in self.pods.values()} if self.pods is not None else {}
        for gpu, (namespace, pod) in named.items():
            if gpu in data.gpu_owner or data.gpu_pods.get(gpu, 0) > 1:
                continue
            info = infos.get((namespace, pod))
            w = Workload(namespace, pod, "", "kubernetes", info.job, info.workload) if info else \
                Workload(namespace, pod, "", "dcgm")
            data.gpu_owner[gpu] = (namespace, pod, w.job, workload_id(w))

    @staticmethod
    def _view(h: SourceHealth, more_errors: int = 0) -> SourceView:
        state, reason, errors = h.view()
        return SourceView(h.name, state in (OK, WAITING), state, reason, errors + more_errors)

    def _attribution_view(self) -> SourceView:
        errors = (self.pods.errors if self.pods else 0) + (self.registrations.errors if self.registrations else 0)
        parts, state = [], OK
        if self.pods is not None:
            if self.pods.last_error:
                state = FAILING
                parts.append(f"Kubernetes: {self.pods.last_error}")
            elif not self.pods.synced.is_set():
                state = WAITING
                parts.append("Kubernetes: first pod list pending")
            else:
                parts.append(f"Kubernetes: {len(self.pods)} pods on {self.config.node}")
        if self.registrations is not None:
            parts.append(f"registry: {len(self.registrations)} records")
            if self.registrations.invalid:
                parts.append(f"{len(self.registrations.invalid)} unreadable")
        if not parts:
            parts.append("no Kubernetes and no registry: processes are labelled namespace=local")
        return SourceView("attribution", state in (OK, WAITING), state, "; ".join(parts), errors)

    # ---- async driving -----------------------------------------------------------------------

    async def run_background(self, stop: asyncio.Event) -> None:
        """Tick and poll DCGM until `stop` is set."""
        tasks = [asyncio.create_task(self._tick_loop(stop))]
        session = None
        if self.dcgm is not None:
            import aiohttp
            session = aiohttp.ClientSession()
            tasks.append(asyncio.create_task(self.dcgm.run(session, stop)))
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if session is not None:
                await session.close()

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.tick)
            except Exception:   # a bug in one tick must not stop discovery for good
                log.error("tick.failed", exc_info=True)
            try:
                await asyncio.wait_for(stop.wait(), self.config.scan_interval_s)
            except asyncio.TimeoutError:
                pass

