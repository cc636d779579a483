"""Workload stories for the promtool tests: three incidents, the extra diagnoses, and non-events.

Each scenario is a timeline of per-minute samples, written the way the exporter and Prometheus
would produce them: counters per (node, gpu, namespace, pod, container) with the scrape's
`instance` and `job` labels, a staleness marker when a series disappears (job end, exporter
down), counters restarting at 0 after an exporter restart, and `gpulens_gpu_pods` derived from the
pods alive on each GPU. `promtool_tests` renders them to promtool test files.

The numbers follow DESIGN.md "Three incidents the signals must tell apart": a busy trainer
launches 2000 kernels/s, spends 30% of its time blocked in syncs, feeds 50 MB/s host-to-device
and copies 0.2 MB/s back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = ["Steps", "Pod", "Expect", "Scenario", "RawSeries", "INCIDENTS", "NON_EVENTS",
           "EXPORTER", "RECORDING", "WORKERS", "WORKER_COUNTS", "ALL"]

Value = Union[float, str]  # a number, "stale" or "_" (no sample)

SCRAPE_JOB = "gpulens-exporter"
NODE = "gpu-node-1"
INSTANCE = "10.0.0.11:9450"

LAUNCHES = 2000.0     # kernel launches per second
SYNC = 0.3            # seconds blocked per second
H2D = 50e6            # bytes per second host-to-device
D2H = 0.2e6           # bytes per second device-to-host
MEMORY = 20e9         # GPU memory bytes in use


@dataclass(frozen=True)
class Steps:
    """A piecewise-constant rate: ((from_minute, value), ...), with an optional cycle of factors."""

    steps: tuple[tuple[int, float], ...]
    jitter: tuple[float, ...] = (1.0,)

    def at(self, minute: int) -> float:
        value = 0.0
        for start, v in self.steps:
            if minute >= start:
                value = v
        return value * self.jitter[minute % len(self.jitter)]


def flat(value: float) -> Steps:
    return Steps(((0, value),))


def change(before: float, at: int, after: float) -> Steps:
    return Steps(((0, before), (at, after)))


@dataclass(frozen=True)
class Pod:
    namespace: str
    pod: str
    gpu: str = "0"
    container: str = "trainer"
    node: str = NODE
    gpulens_job: str | None = None
    # the exporter's gpulens_workload: job/<gpulens_job>, else the owner, else Pod/<pod>
    workload: str | None = None
    launches: Steps = flat(LAUNCHES)
    graph_launches: Steps | None = None
    sync_wait: Steps = flat(SYNC)
    h2d: Steps = flat(H2D)
    d2h: Steps = flat(D2H)
    start: int = 0           # first sample (counters start at 0 here)
    end: int | None = None   # the process exits at this minute
    # The exporter keeps a series' counters (flat) for --retired-ttl (default 900 s) after its
    # last process exits, so a restart of one rank does not reset the series; NVML gauges go at once.
    retired_ttl: int = 15
    # the pod's process is gone for minutes [a, b) and then restarts in the same pod: NVML lists
    # no process meanwhile, the exporter keeps the counters (flat) and continues them afterwards
    restart_gap: tuple[int, int] | None = None
    # torchrun workers in the container: 1 is a process without a rank (no `rank` label); N > 1
    # are ranks 0..N-1, each its own series on its own GPU (gpu + rank; all "unknown" without
    # NVML), each at the per-worker rates above (so the pod's sums are N times them)
    workers: int = 1

    def ranks(self) -> list[tuple[str, str | None]]:
        """(gpu, rank) of each worker series."""
        if self.workers == 1:
            return [(self.gpu, None)]
        gpu = (lambda r: "unknown") if self.gpu == "unknown" else (lambda r: str(int(self.gpu) + r))
        return [(gpu(r), str(r)) for r in range(self.workers)]

    def exported(self, minute: int) -> bool:
        """Counters are exported: alive, or within the retired TTL after the exit."""
        return self.start <= minute and (self.end is None or minute < self.end + self.retired_ttl)

    def alive(self, minute: int) -> bool:
        if self.restart_gap and self.restart_gap[0] <= minute < self.restart_gap[1]:
            return False
        return self.start <= minute and (self.end is None or minute < self.end)

    @property
    def gpulens_workload(self) -> str:
        if self.workload:
            return self.workload
        return f"job/{self.gpulens_job}" if self.gpulens_job else f"Pod/{self.pod}"

    def alert_labels(self) -> dict[str, str]:
        labels = {"namespace": self.namespace, "pod": self.pod, "node": self.node,
                  "gpulens_workload": self.gpulens_workload}
        if self.gpulens_job:
            labels["gpulens_job"] = self.gpulens_job
        return labels


@dataclass(frozen=True)
class RawSeries:
    """A series given sample by sample (exporter self-metrics)."""

    series: str
    values: tuple[Value, ...]


@dataclass(frozen=True)
class Expect:
    """At `minute`, exactly these alerts fire (every other alert name: none)."""

    minute: int
    firing: tuple[tuple[str, dict[str, str]], ...] = ()


@dataclass(frozen=True)
class ExpectSamples:
    minute: int
    expr: str
    samples: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    story: str
    minutes: int
    pods: tuple[Pod, ...] = ()
    raw: tuple[RawSeries, ...] = ()
    expect: tuple[Expect, ...] = ()
    expect_samples: tuple[ExpectSamples, ...] = ()
    # exporter down for minutes [a, b): every series of the node goes stale at a; counters
    # restart from 0 at b (from a new scrape address if `instance_after_outage` is set)
    outage: tuple[int, int] | None = None
    instance_after_outage: str | None = None
    nvml: bool = True   # NVML works on the node: per-process memory and pods per GPU are exported

    # --- samples ---------------------------------------------------------------------------
    def series(self) -> list[tuple[str, list[Value]]]:
        out: list[tuple[str, list[Value]]] = []
        for pod in self.pods:
            out.extend(self._pod_series(pod))
        if self.pods:
            out.extend(self._gpu_series())
            out.extend(self._source_series())
        out.extend((r.series, list(r.values)) for r in self.raw)
        return out

    def _instance(self, minute: int) -> str:
        if self.outage and self.instance_after_outage and minute >= self.outage[1]:
            return self.instance_after_outage
        return INSTANCE

    def _instances(self) -> list[str]:
        return [INSTANCE] + ([self.instance_after_outage] if self.instance_after_outage else [])

    def _down(self, minute: int) -> bool:
        return bool(self.outage and self.outage[0] <= minute < self.outage[1])

    def _gauge(self, selector: str, alive, value) -> list[tuple[str, list[Value]]]:
        out = []
        for inst in self._instances():
            values: list[Value] = []
            prev_present = False
            for t in range(self.minutes + 1):
                present = alive(t) and not self._down(t) and self._instance(t) == inst
                if present:
                    values.append(value(t))
                else:
                    values.append("stale" if prev_present else "_")
                prev_present = present
            if any(v not in ("_", "stale") for v in values):
                out.append((_series(selector, inst), values))
        return out

    def _counter(self, selector: str, pod: Pod, rate: Steps) -> list[tuple[str, list[Value]]]:
        out = []
        for inst in self._instances():
            values: list[Value] = []
            total = 0.0
            prev_present = False
            for t in range(self.minutes + 1):
                present = pod.exported(t) and not self._down(t) and self._instance(t) == inst
                restarted = self.outage is not None and t == self.outage[1]
                if present:
                    if restarted:
                        total = rate.at(t) * 30 if pod.alive(t) else 0.0  # counted since the restart
                    elif prev_present and pod.alive(t - 1):
                        total += rate.at(t - 1) * 60
                    values.append(round(total, 6))
                else:
                    values.append("stale" if prev_present else "_")
                prev_present = present
            if any(v not in ("_", "stale") for v in values):
                out.append((_series(selector, inst), values))
        return out

    def _pod_series(self, pod: Pod) -> list[tuple[str, list[Value]]]:
        out: list[tuple[str, list[Value]]] = []
        for gpu, rank in pod.ranks():
            out += self._worker_series(pod, gpu, rank)
        return out

    def _worker_series(self, pod: Pod, gpu: str, rank: str | None) -> list[tuple[str, list[Value]]]:
        base = (f'node="{pod.node}", gpu="{gpu}", namespace="{pod.namespace}", '
                f'pod="{pod.pod}", container="{pod.container}"')
        if pod.gpulens_job:
            base += f', gpulens_job="{pod.gpulens_job}"'
        base += f', gpulens_workload="{pod.gpulens_workload}"'
        if rank is not None:
            base += f', rank="{rank}"'
        out = self._counter(f"gpulens_kernel_launches_total{{{base}}}", pod, pod.launches)
        if pod.graph_launches is not None:
            out += self._counter(f"gpulens_graph_launches_total{{{base}}}", pod, pod.graph_launches)
        out += self._counter(f"gpulens_sync_wait_seconds_total{{{base}}}", pod, pod.sync_wait)
        out += self._counter(f'gpulens_memcpy_bytes_total{{{base}, direction="h2d"}}', pod, pod.h2d)
        out += self._counter(f'gpulens_memcpy_bytes_total{{{base}, direction="d2h"}}', pod, pod.d2h)
        if self.nvml:
            out += self._gauge(f"gpulens_process_gpu_memory_bytes{{{base}}}", pod.alive, lambda t: MEMORY)
        return out

    def _source_series(self) -> list[tuple[str, list[Value]]]:
        out = []
        for node in sorted({p.node for p in self.pods}):
            out += self._gauge(f'gpulens_exporter_source_up{{node="{node}", source="nvml"}}', lambda t: True,
                               lambda t: 1.0 if self.nvml else 0.0)
        return out

    def _gpu_series(self) -> list[tuple[str, list[Value]]]:
        out: list[tuple[str, list[Value]]] = []
        if not self.nvml:
            return out
        for node, gpu in sorted({(p.node, g) for p in self.pods for g, _ in p.ranks()}):
            on_gpu = [p for p in self.pods if (node, gpu) in {(p.node, g) for g, _ in p.ranks()}]
            out += self._gauge(f'gpulens_gpu_pods{{node="{node}", gpu="{gpu}"}}', lambda t: True,
                               lambda t, on_gpu=on_gpu: float(sum(p.alive(t) for p in on_gpu)))
        return out


def _series(selector: str, instance: str) -> str:
    name, rest = selector.split("{", 1)
    return f'{name}{{instance="{instance}", job="{SCRAPE_JOB}", {rest}'


def fires(alertname: str, pod: Pod, diagnosis: str) -> tuple[str, dict[str, str]]:
    """The alert `alertname` for `pod`, with the diagnosis the story calls for (not the rule's)."""
    return (alertname, {**pod.alert_labels(), "diagnosis": diagnosis})


# --- the three incidents of DESIGN.md, and the extra diagnoses -------------------------------
T = 60  # the incident starts here; every pod has 60 minutes of steady history before it

_victim = Pod("ml", "llama-ft-0", gpulens_job="llama-ft")
_host_sync = Pod("ml", "llama-ft-0", gpulens_job="llama-ft",
                 launches=change(LAUNCHES, T, 1950.0), sync_wait=change(SYNC, T, 0.55),
                 d2h=change(D2H, T, 40e6))
_nn_victim = Pod("ml", "resnet-0", sync_wait=change(SYNC, T, 0.2),
                 launches=change(LAUNCHES, T, 1000.0), h2d=change(H2D, T, 25e6))
_nn_neighbour = Pod("batch", "etl-7f9c", container="worker", start=T, launches=flat(900.0))
_starved = Pod("ml", "bert-0", launches=change(LAUNCHES, T, 900.0), sync_wait=change(SYNC, T, 0.1),
               h2d=change(H2D, T, 15e6))
_slow_gpu = Pod("ml", "vit-0", launches=change(LAUNCHES, T, 1000.0), sync_wait=change(SYNC, T, 0.7),
                h2d=change(H2D, T, 25e6))
_stalled = Pod("ml", "gpt-3", launches=change(LAUNCHES, T, 0.0), sync_wait=change(SYNC, T, 0.0),
               h2d=change(H2D, T, 0.0), d2h=change(D2H, T, 0.0))
_unexplained = Pod("ml", "dlrm-0", launches=change(LAUNCHES, T, 1000.0))
_no_nvml = Pod("ml", "dlrm-1", gpu="unknown", launches=change(LAUNCHES, T, 1000.0))
_shared_starved = Pod("ml", "bert-1", launches=change(LAUNCHES, T, 900.0),
                      sync_wait=change(SYNC, T, 0.1), h2d=change(H2D, T, 15e6))
_shared_other = Pod("ml", "bert-eval-0", launches=flat(500.0))


def _incident(name: str, story: str, pods: tuple[Pod, ...], fired_at: int,
              firing: tuple[str, Pod, str], nvml: bool = True) -> Scenario:
    return Scenario(
        name=name, story=story, minutes=80, pods=pods, nvml=nvml,
        # T+7: the condition holds but `for:` has not elapsed yet (pending is not firing)
        expect=(Expect(T - 10), Expect(T + 3), Expect(T + 7), Expect(fired_at, (fires(*firing),))),
    )


INCIDENTS: tuple[Scenario, ...] = (
    _incident("host_sync",
              "A 'logging only' change copies tensors to the host every step: demand flat, "
              "back-pressure 0.30 -> 0.55, D2H 0.2 -> 40 MB/s, one pod on the GPU. The job's "
              "gpulens_job label is carried into the alert.",
              (_host_sync,), T + 15, ("GPUWorkloadHostSync", _host_sync, "host_sync")),
    _incident("noisy_neighbor",
              "Another team's batch pod lands on the same GPU: the victim's demand halves and its "
              "back-pressure and transfers fall with it; pods on the GPU 1 -> 2. The newcomer has "
              "no baseline and stays silent.",
              (_nn_victim, _nn_neighbour), T + 15, ("GPUWorkloadNoisyNeighbor", _nn_victim, "noisy_neighbor")),
    _incident("input_starvation",
              "The trainer's CPU limit is lowered: demand -55%, back-pressure falls, H2D "
              "50 -> 15 MB/s, one pod on the GPU.",
              (_starved,), T + 15, ("GPUWorkloadInputStarvation", _starved, "input_starvation")),
    _incident("input_starvation_on_shared_gpu",
              "Input starvation of a pod that has always shared its GPU with another: contention "
              "that was there all along is not a new neighbour.",
              (_shared_starved, _shared_other), T + 15,
              ("GPUWorkloadInputStarvation", _shared_starved, "input_starvation")),
    _incident("device_slowdown",
              "The GPU throttles: demand halves while the host waits on it longer "
              "(0.30 -> 0.70), no new D2H, no neighbour.",
              (_slow_gpu,), T + 15, ("GPUWorkloadDeviceSlowdown", _slow_gpu, "device_slowdown")),
    _incident("stalled",
              "A collective hangs: launches, syncs and copies stop while the process lives on.",
              (_stalled,), T + 15, ("GPUWorkloadStalled", _stalled, "stalled")),
    _incident("unclassified_demand_drop",
              "Demand halves with back-pressure, transfers and contention unchanged.",
              (_unexplained,), T + 17, ("GPUWorkloadDemandDrop", _unexplained, "unclassified")),
    _incident("unclassified_demand_drop_without_nvml",
              "The same drop on a node without NVML (gpu 'unknown', no contention or memory "
              "series): the pod's exported counters stand in for a live process.",
              (_no_nvml,), T + 17, ("GPUWorkloadDemandDrop", _no_nvml, "unclassified"), nvml=False),
)


# --- non-events: all of these must stay silent ------------------------------------------------
_quiet = tuple(Expect(m) for m in (40, 60, 61, 62, 63, 65, 70, 80, 100, 119))

NON_EVENTS: tuple[Scenario, ...] = (
    Scenario("steady_job", "Two hours of a steady trainer with +-10% minute-to-minute jitter.",
             120, pods=(Pod("ml", "steady-0",
                            launches=Steps(((0, LAUNCHES),), jitter=(1.0, 0.9, 1.1, 0.95, 1.05)),
                            sync_wait=Steps(((0, SYNC),), jitter=(1.0, 1.1, 0.9)),
                            graph_launches=flat(10.0)),), expect=_quiet),
    Scenario("job_ends",
             "The job winds down (a final evaluation at 40% of its demand and 30% of its feed for "
             "6 minutes) and exits at minute 60. The exporter keeps its counters, flat, for 15 more "
             "minutes; NVML stops listing its processes at once. A job that has gone is not a "
             "demand drop, a starved input or a stall.",
             120, pods=(Pod("ml", "done-0", launches=change(LAUNCHES, 54, 800.0),
                            sync_wait=change(SYNC, 54, 0.05), h2d=change(H2D, 54, 15e6), end=60),),
             expect=_quiet),
    Scenario("job_ends_without_nvml",
             "A node without NVML: the job exits at minute 60 and its counters stay exported, flat, "
             "for 15 minutes. Without a live-process signal a stall cannot be told from an exit, "
             "so nothing may fire.",
             120, pods=(Pod("ml", "done-0", gpu="unknown", end=60),), nvml=False, expect=_quiet),
    Scenario("exporter_restart_counter_reset",
             "The exporter is down for minutes 60-61 and restarts: every series goes stale and "
             "the counters restart from 0 at minute 62.",
             120, pods=(Pod("ml", "steady-0"),), outage=(60, 62), expect=_quiet),
    Scenario("exporter_restart_between_scrapes",
             "The exporter restarts within one scrape interval: no sample is missed, so no "
             "staleness; the counters just drop to 0 at minute 60. The recorded rate must not dip.",
             120, pods=(Pod("ml", "steady-0"),), outage=(60, 60), expect=_quiet,
             expect_samples=tuple(
                 s for m in range(59, 67) for s in (
                     ExpectSamples(m, "count(namespace_pod:gpulens_launches:rate5m < 1500)", ()),
                     ExpectSamples(m, "count(namespace_pod:gpulens_launches:rate5m >= 1500)", (("{}", 1.0),)),
                 ))),
    Scenario("exporter_pod_replaced",
             "The exporter pod is replaced (3 minutes down): counters restart at 0 under a new "
             "scrape address, so every series is new.",
             120, pods=(Pod("ml", "steady-0"),), outage=(60, 63),
             instance_after_outage="10.0.0.12:9450", expect=_quiet),
    Scenario("brief_dip",
             "A neighbour visits the GPU for 5 minutes and the trainer's demand drops to 30% meanwhile: "
             "a blip, not an incident (`for:`).",
             120, pods=(Pod("ml", "steady-0", launches=Steps(((0, LAUNCHES), (60, 600.0), (65, LAUNCHES)))),
                        Pod("batch", "visitor-0", start=60, end=65, launches=flat(900.0))),
             expect=_quiet),
    Scenario("neighbour_without_slowdown",
             "A pod joins the GPU and the trainer's host waits longer (0.30 -> 0.60) but its demand "
             "holds: no throughput anomaly, and the waiting is not a host_sync change.",
             120, pods=(Pod("ml", "steady-0", sync_wait=change(SYNC, 60, 0.6)),
                        Pod("batch", "etl-1", start=60, launches=flat(500.0))),
             expect=_quiet),
    Scenario("tiny_traffic",
             "A notebook launching 10 kernels/s drops to 1/s while its back-pressure and D2H "
             "rise and H2D vanishes: below the 20 launches/s minimum baseline, nothing alerts.",
             120, pods=(Pod("ml", "notebook-0", launches=change(10.0, 60, 1.0),
                            sync_wait=change(0.01, 60, 0.5), h2d=change(100e3, 60, 0.0),
                            d2h=change(1e3, 60, 20e6)),), expect=_quiet),
    Scenario("young_job",
             "A job starts at minute 50, warms up for 5 minutes at 200 launches/s, runs at 2000 "
             "and dips to 600 at minute 65: with under 35 minutes of history it has no baseline "
             "to drop from.",
             84, pods=(Pod("ml", "young-0", start=50,
                           launches=Steps(((0, 200.0), (55, LAUNCHES), (65, 600.0))),
                           h2d=Steps(((0, 1e6), (55, H2D), (65, 10e6)))),),
             expect=tuple(Expect(m) for m in (55, 60, 70, 75, 80, 84))),
    Scenario("shared_gpu_steady",
             "Two pods share one GPU the whole time: contention that was always there does not "
             "'appear'.", 120,
             pods=(Pod("ml", "a-0"), Pod("ml", "b-0", launches=flat(1500.0))), expect=_quiet),
)


# --- exporter self-metrics ---------------------------------------------------------------------
def _raw(name: str, labels: str, values: list[Value]) -> RawSeries:
    return RawSeries(f'{name}{{instance="{INSTANCE}", job="{SCRAPE_JOB}", node="{NODE}", {labels}}}',
                     tuple(values))


def _exporter_fires(alertname: str, **labels: str) -> tuple[str, dict[str, str]]:
    return (alertname, {"instance": INSTANCE, "job": SCRAPE_JOB, "node": NODE,
                        "diagnosis": "exporter_degraded", **labels})


EXPORTER: tuple[Scenario, ...] = (
    Scenario("exporter_source_lost",
             "NVML worked for 30 minutes and then failed; eBPF was never available on this node "
             "(no libcuda) and must not alert.", 60,
             raw=(_raw("gpulens_exporter_source_up", 'source="nvml"', [1.0] * 30 + [0.0] * 31),
                  _raw("gpulens_exporter_source_up", 'source="ebpf"', [0.0] * 61)),
             expect=(Expect(35), Expect(45, (_exporter_fires("GPULensExporterSourceLost",
                                                             source="nvml"),)))),
    Scenario("exporter_map_nearly_full",
             "The process map is 95% full, the cgroup map 10%; a map with capacity 0 is not a "
             "division by zero.", 30,
             raw=(_raw("gpulens_exporter_map_entries", 'map="procs"', [950.0] * 31),
                  _raw("gpulens_exporter_map_capacity", 'map="procs"', [1000.0] * 31),
                  _raw("gpulens_exporter_map_entries", 'map="cgroups"', [100.0] * 31),
                  _raw("gpulens_exporter_map_capacity", 'map="cgroups"', [1000.0] * 31),
                  _raw("gpulens_exporter_map_entries", 'map="spare"', [0.0] * 31),
                  _raw("gpulens_exporter_map_capacity", 'map="spare"', [0.0] * 31)),
             expect=(Expect(10), Expect(20, (_exporter_fires("GPULensExporterMapNearlyFull",
                                                             map="procs"),)))),
)


# --- recording rules: exact values on a steady two-GPU pod ------------------------------------
_two_gpu = (Pod("ml", "ddp-0", gpu="0", launches=flat(1000.0), graph_launches=flat(50.0),
                sync_wait=flat(0.5)),
            Pod("ml", "ddp-0", gpu="1", launches=flat(1000.0), graph_launches=flat(50.0),
                sync_wait=flat(0.5)))
_ddp = {"namespace": "ml", "pod": "ddp-0", "node": NODE, "gpulens_workload": "Pod/ddp-0"}
_ddp_workload = {"namespace": "ml", "gpulens_workload": "Pod/ddp-0"}


def _labels(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> str:
    merged = {**(_ddp if base is None else base), **(extra or {})}
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(merged.items())) + "}"


_wl = {"namespace": "ml", "gpulens_workload": "job/mixed"}
_blip = {"namespace": "ml", "pod": "blip-0", "node": NODE, "gpulens_workload": "Pod/blip-0"}
_restart = {"namespace": "ml", "pod": "restart-0", "node": NODE, "gpulens_workload": "Pod/restart-0"}
_mixed = (Pod("ml", "mixed-0", gpulens_job="mixed", launches=flat(1000.0), sync_wait=flat(0.25), h2d=flat(10e6)),
          Pod("ml", "mixed-1", gpu="1", gpulens_job="mixed", launches=flat(3000.0), sync_wait=flat(0.75),
              h2d=flat(30e6)),
          # started at 45: not settled (10 minutes of life) at 50, so not counted in its workload
          Pod("ml", "mixed-2", gpu="2", gpulens_job="mixed", start=45, launches=flat(100.0)))

_eight = {"namespace": "ml", "pod": "eight-0", "node": NODE, "gpulens_workload": "Pod/eight-0"}
_GRAPHS_POD = 'gpu="0", namespace="ml", pod="graphs-0", container="trainer", gpulens_workload="Pod/graphs-0"'

RECORDING: tuple[Scenario, ...] = (
    Scenario("recording_graph_demand",
             "Demand counts kernels run through CUDA graphs (1024/s from 64 graph launches/s of 16 "
             "kernels) and graph launches of unknown size once each (4/s), not graph launches once.", 50,
             pods=(Pod("ml", "graphs-0", launches=flat(1000.0), graph_launches=flat(68.0)),),
             raw=(_raw("gpulens_graph_kernels_total", _GRAPHS_POD, [61_440.0 * m for m in range(51)]),
                  _raw("gpulens_graph_unknown_launches_total", _GRAPHS_POD, [240.0 * m for m in range(51)])),
             expect_samples=(
                 ExpectSamples(50, "namespace_pod:gpulens_launches:rate5m",
                               (('namespace_pod:gpulens_launches:rate5m{gpulens_workload="Pod/graphs-0", '
                                 'namespace="ml", node="gpu-node-1", pod="graphs-0"}', 2028.0),)),
             )),
    Scenario("recording_back_pressure_unavailable",
             "A node whose exporter turned return probes off says so, with the reason.", 5,
             raw=(_raw("gpulens_exporter_source_info",
                       'source="return_probes", state="disabled", reason="killed under seccomp"', [1.0] * 6),),
             expect_samples=(
                 ExpectSamples(5, "node:gpulens_back_pressure_unavailable:info",
                               (('node:gpulens_back_pressure_unavailable:info{node="gpu-node-1", '
                                 'reason="killed under seccomp"}', 1.0),)),
             )),
    Scenario("recording_rules",
             "A DDP pod with one rank on each of two GPUs: per-pod sums, per-worker values, the "
             "scrape's instance/job labels aggregated away, per-worker baselines and the ratio gate.", 50,
             pods=_two_gpu,
             expect_samples=(
                 ExpectSamples(50, "namespace_pod:gpulens_launches:rate5m",
                               ((f"namespace_pod:gpulens_launches:rate5m{_labels()}", 2100.0),)),
                 ExpectSamples(50, "namespace_pod:gpulens_sync_wait_seconds:rate5m",
                               ((f"namespace_pod:gpulens_sync_wait_seconds:rate5m{_labels()}", 1.0),)),
                 ExpectSamples(50, "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m",
                               ((f"namespace_pod:gpulens_sync_wait_seconds:avg_rate5m{_labels()}", 0.5),)),
                 ExpectSamples(50, 'namespace_pod_direction:gpulens_memcpy_bytes:rate5m{direction="h2d"}',
                               ((f"namespace_pod_direction:gpulens_memcpy_bytes:rate5m"
                                 f"{_labels({'direction': 'h2d'})}", 2 * H2D),)),
                 ExpectSamples(50, "namespace_pod:gpulens_gpu_pods:max",
                               ((f"namespace_pod:gpulens_gpu_pods:max{_labels()}", 1.0),)),
                 # two workers (one series per GPU): the judged signals are per worker
                 ExpectSamples(50, "namespace_pod:gpulens_workers:count",
                               ((f"namespace_pod:gpulens_workers:count{_labels()}", 2.0),)),
                 ExpectSamples(50, "namespace_pod:gpulens_launches_per_worker:rate5m",
                               ((f"namespace_pod:gpulens_launches_per_worker:rate5m{_labels()}", 1050.0),)),
                 ExpectSamples(50, 'namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m{direction="h2d"}',
                               ((f"namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m"
                                 f"{_labels({'direction': 'h2d'})}", H2D),)),
                 ExpectSamples(50, "namespace_workload:gpulens_launches_per_worker:baseline30m_rate5m",
                               ((f"namespace_workload:gpulens_launches_per_worker:baseline30m_rate5m"
                                 f"{_labels(base=_ddp_workload)}", 1050.0),)),
                 ExpectSamples(50, "namespace_workload:gpulens_launches_per_worker:baseline_rate5m",
                               ((f"namespace_workload:gpulens_launches_per_worker:baseline_rate5m"
                                 f"{_labels(base=_ddp_workload)}", 1050.0),)),
                 ExpectSamples(50, "namespace_pod:gpulens_launches_per_baseline:ratio_rate5m",
                               ((f"namespace_pod:gpulens_launches_per_baseline:ratio_rate5m{_labels()}", 1.0),)),
                 # settled after 10 minutes of life, not before
                 ExpectSamples(9, "namespace_pod:gpulens_live:settled", ()),
                 ExpectSamples(10, "namespace_pod:gpulens_live:settled",
                               ((f"namespace_pod:gpulens_live:settled{_labels()}", 1.0),)),

                 # a workload with under 35 minutes of history has no baseline yet, so no gate
                 ExpectSamples(44, "namespace_workload:gpulens_launches_per_worker:baseline_rate5m", ()),
                 ExpectSamples(44, "namespace_pod:gpulens_launches_per_baseline:ratio_rate5m", ()),
                 ExpectSamples(45, "namespace_workload:gpulens_launches_per_worker:baseline_rate5m",
                               ((f"namespace_workload:gpulens_launches_per_worker:baseline_rate5m"
                                 f"{_labels(base=_ddp_workload)}", 1050.0),)),
                 ExpectSamples(50, "namespace_workload:gpulens_off_baseline:group", ()),
                 # nothing rising or falling in a steady pod
                 ExpectSamples(50, "namespace_pod:gpulens_gpu_pods:max_rising", ()),
                 ExpectSamples(50, "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m_rising", ()),
                 ExpectSamples(50, "namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m_rising", ()),
                 ExpectSamples(50, "namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m_falling", ()),
             )),
    Scenario("recording_settled_through_a_missed_listing",
             "One pod's process is missing for one minute (a failed scrape or NVML listing): it stays "
             "settled. Another's is gone for 3 minutes (a process restart): it settles anew 10 minutes "
             "after it is back.", 45,
             pods=(Pod("ml", "blip-0", restart_gap=(25, 26)), Pod("ml", "restart-0", gpu="1", restart_gap=(25, 28))),
             expect_samples=(
                 ExpectSamples(25, "namespace_pod:gpulens_live:settled{pod=\"blip-0\"}", ()),
                 ExpectSamples(26, "namespace_pod:gpulens_live:settled{pod=\"blip-0\"}",
                               ((f"namespace_pod:gpulens_live:settled{_labels(base=_blip)}", 1.0),)),
                 ExpectSamples(30, "namespace_pod:gpulens_live:settled{pod=\"restart-0\"}", ()),
                 ExpectSamples(37, "namespace_pod:gpulens_live:settled{pod=\"restart-0\"}", ()),
                 ExpectSamples(38, "namespace_pod:gpulens_live:settled{pod=\"restart-0\"}",
                               ((f"namespace_pod:gpulens_live:settled{_labels(base=_restart)}", 1.0),)),
             )),
    Scenario("recording_per_pod_workload",
             "A job of three pods: the workload's signals are means over its settled pods (per-pod "
             "normalisation), and a pod still in its warm-up is not counted.", 55,
             pods=_mixed,
             expect_samples=(
                 ExpectSamples(50, "namespace_workload:gpulens_launches_per_worker:rate5m",
                               ((f"namespace_workload:gpulens_launches_per_worker:rate5m{_labels(base=_wl)}", 2000.0),)),
                 ExpectSamples(50, "namespace_workload:gpulens_sync_wait_seconds:avg_rate5m",
                               ((f"namespace_workload:gpulens_sync_wait_seconds:avg_rate5m{_labels(base=_wl)}", 0.5),)),
                 ExpectSamples(50, 'namespace_workload_direction:gpulens_memcpy_bytes_per_worker:rate5m{direction="h2d"}',
                               ((f"namespace_workload_direction:gpulens_memcpy_bytes_per_worker:rate5m"
                                 f"{_labels({'direction': 'h2d'}, base=_wl)}", 20e6),)),
                 ExpectSamples(50, "namespace_workload:gpulens_gpu_pods:avg_max",
                               ((f"namespace_workload:gpulens_gpu_pods:avg_max{_labels(base=_wl)}", 1.0),)),
                 ExpectSamples(55, "namespace_workload:gpulens_launches_per_worker:rate5m",
                               ((f"namespace_workload:gpulens_launches_per_worker:rate5m{_labels(base=_wl)}",
                                 (1000.0 + 3000.0 + 100.0) / 3),)),
             )),
)




# --- workloads across pod replacement, scaling and lasting regressions (issue 14) --------------
# Pods come and go as Kubernetes makes them: a new pod has a new name and starts with a short
# warm-up (WARMUP minutes at a tenth of its demand and feed). The baseline belongs to the
# workload (gpulens_workload), so a new pod inherits it; the alerts state exactly when they fire
# and when they stop.
WARMUP = 8
LONG = 200   # minutes: long enough to see a lasting regression become the new normal


def _warm(start: int, value: float, then: Steps | None = None) -> Steps:
    """A new pod's rate: a tenth of `value` for WARMUP minutes, then `value` (or the steps `then`)."""
    steps = [(start, value / 10), (start + WARMUP, value)]
    if then is not None:
        steps += [(m, v) for m, v in then.steps if m > start + WARMUP]
    return Steps(tuple(steps))


def _new_pod(namespace: str, pod: str, start: int, *, end: int | None = None, launches: float = LAUNCHES,
             sync: float = SYNC, h2d: float = H2D, d2h: float = D2H, **kw) -> Pod:
    return Pod(namespace, pod, start=start, end=end, launches=_warm(start, launches),
               sync_wait=_warm(start, sync), h2d=_warm(start, h2d), d2h=_warm(start, d2h), **kw)


def _window(alert: tuple[str, dict[str, str]] | None, silent_until: int, fires: tuple[int, int] | None,
            minutes: int, extra: tuple[int, ...] = ()) -> tuple[Expect, ...]:
    """Silence before `fires[0]` (checked at the minute before it and at `silent_until` and
    `extra`), firing from `fires[0]` through `fires[1] - 1`, and silence from `fires[1]` on."""
    points: dict[int, tuple] = {m: () for m in (silent_until, *extra) if m <= minutes}
    if fires is not None and alert is not None:
        start, stop = fires
        points[start - 1] = ()
        for m in (start, start + 1, (start + stop) // 2, stop - 1):
            points[m] = (alert,)
        if stop <= minutes:
            points[stop] = ()
        if stop + 15 <= minutes:
            points[stop + 15] = ()
    return tuple(Expect(m, firing) for m, firing in sorted(points.items()))


_job = "llama-ft"
_rd_old = Pod("ml", "llama-ft-worker-0-h2x7k", gpulens_job=_job, end=T)
_rd_new = _new_pod("ml", "llama-ft-worker-0-p9q4z", T + 1, gpulens_job=_job,
                   launches=1950.0, sync=0.55, d2h=40e6)

_rs_old = Pod("ml", "bert-trainer-6d5f8c7b9-x2lqm", workload="Deployment/bert-trainer", end=T)
_rs_new = _new_pod("ml", "bert-trainer-7c9d6b5f4-k8mzt", T, workload="Deployment/bert-trainer",
                   launches=900.0, sync=0.1, h2d=15e6)

_nn_hour = Pod("ml", "resnet-worker-0", gpulens_job="resnet",
               sync_wait=Steps(((0, SYNC), (T, 0.2), (T + 60, SYNC))),
               launches=Steps(((0, LAUNCHES), (T, 1000.0), (T + 60, LAUNCHES))),
               h2d=Steps(((0, H2D), (T, 25e6), (T + 60, H2D))))
_nn_hour_neighbour = Pod("batch", "etl-7f9c-q2w", container="worker", start=T, end=T + 60, launches=flat(900.0))

_rb_bad = _new_pod("ml", "llama-ft-worker-0-p9q4z", T + 1, end=T + 40, gpulens_job=_job,
                   launches=1950.0, sync=0.55, d2h=40e6)
_rb_good = _new_pod("ml", "llama-ft-worker-0-r3t8v", T + 41, gpulens_job=_job)

_lasting = Pod("ml", "llama-ft-worker-0", gpulens_job=_job,
               launches=change(LAUNCHES, T, 1950.0), sync_wait=change(SYNC, T, 0.55), d2h=change(D2H, T, 40e6))

_reverted = Pod("ml", "llama-ft-worker-0", gpulens_job=_job,
                launches=Steps(((0, LAUNCHES), (T, 1950.0), (T + 50, LAUNCHES))),
                sync_wait=Steps(((0, SYNC), (T, 0.55), (T + 50, SYNC))),
                d2h=Steps(((0, D2H), (T, 40e6), (T + 50, D2H))))

_dep = "Deployment/web-embed"
_rollout = (Pod("ml", "web-embed-5b7c9-aaaaa", workload=_dep, end=T + 2),
            Pod("ml", "web-embed-5b7c9-bbbbb", gpu="1", workload=_dep, end=T + 4),
            _new_pod("ml", "web-embed-6c8d1-ccccc", T, gpu="2", workload=_dep),
            _new_pod("ml", "web-embed-6c8d1-ddddd", T + 2, gpu="3", workload=_dep))

_ddp = "ddp-run"
_four = tuple(Pod("ml", f"ddp-run-worker-{i}", gpu=str(i), gpulens_job=_ddp, end=T if i >= 2 else None)
              for i in range(4))
_two_then_four = (tuple(Pod("ml", f"ddp-run-worker-{i}", gpu=str(i), gpulens_job=_ddp) for i in range(2))
                  + tuple(_new_pod("ml", f"ddp-run-worker-{i}", T, gpu=str(i), gpulens_job=_ddp) for i in (2, 3)))
_run1 = tuple(Pod("ml", f"llama-ft-worker-{i}-run1", gpu=str(i), gpulens_job=_job, end=T) for i in range(2))
_run2 = tuple(_new_pod("ml", f"llama-ft-worker-{i}-run2", T + 5, gpu=str(i), gpulens_job=_job) for i in range(2))

_restarted = Pod("ml", "steady-worker-0", gpulens_job="steady", restart_gap=(T, T + 3),
                 launches=Steps(((0, LAUNCHES), (T, 0.0), (T + 3, LAUNCHES / 5), (T + 3 + WARMUP, LAUNCHES))),
                 sync_wait=Steps(((0, SYNC), (T, 0.0), (T + 3, SYNC / 5), (T + 3 + WARMUP, SYNC))),
                 h2d=Steps(((0, H2D), (T, 0.0), (T + 3, H2D / 5), (T + 3 + WARMUP, H2D))))

WORKLOADS: tuple[Scenario, ...] = (
    Scenario("redeploy_host_sync",
             "A redeploy of the job (the old pod ends at T, a new pod of the same gpulens_job starts "
             "a minute later) adds a host sync every step: the new pod has no history of its own and "
             "is judged against its workload's baseline once its warm-up is over.",
             LONG, pods=(_rd_old, _rd_new),
             expect=_window(fires(*("GPUWorkloadHostSync", _rd_new, "host_sync")), T - 1, (T + 18, T + 95),
                            LONG, extra=(T + 5, T + 11))),
    Scenario("resize_input_starvation",
             "A lower CPU limit recreates a Deployment's pod (no job label: the workload is the "
             "Deployment): the new pod's input pipeline starves the GPU.",
             LONG, pods=(_rs_old, _rs_new),
             expect=_window(fires(*("GPUWorkloadInputStarvation", _rs_new, "input_starvation")), T - 1,
                            (T + 15, T + 95), LONG, extra=(T + 5,))),
    Scenario("noisy_neighbor_for_an_hour",
             "A batch pod shares the victim's GPU for an hour: the alert lasts as long as the "
             "neighbour stays (the baseline does not absorb it) and resolves soon after it leaves.",
             LONG, pods=(_nn_hour, _nn_hour_neighbour),
             expect=_window(fires(*("GPUWorkloadNoisyNeighbor", _nn_hour, "noisy_neighbor")), T - 1,
                            (T + 10, T + 60), LONG)),
    Scenario("rollback_resolves",
             "The host-sync redeploy is rolled back 40 minutes later (a third pod, the old behaviour): "
             "the alert stops with the regressed pod and nothing fires for the rolled-back one.",
             LONG, pods=(_rd_old, _rb_bad, _rb_good),
             expect=_window(fires(*("GPUWorkloadHostSync", _rb_bad, "host_sync")), T - 1, (T + 18, T + 40),
                            LONG, extra=(T + 51, T + 60, T + 100))),
    Scenario("host_sync_reverted_in_place",
             "The host-sync change is switched off in the same pod 50 minutes later: the alert, "
             "which the baseline kept firing, resolves as soon as back-pressure is back near it.",
             LONG, pods=(_reverted,),
             expect=_window(fires(*("GPUWorkloadHostSync", _reverted, "host_sync")), T - 1, (T + 9, T + 52),
                            LONG, extra=(T + 100,))),
    Scenario("host_sync_lasting",
             "The host-sync change in place, never reverted: the alert lasts while the baseline holds "
             "the old level, then the change becomes the new normal and the alert resolves.",
             LONG, pods=(_lasting,),
             expect=_window(fires(*("GPUWorkloadHostSync", _lasting, "host_sync")), T - 1, (T + 9, T + 96),
                            LONG)),
)

# every minute around the change (a warm-up alert would be pending for 5 minutes, then fire),
# and sparsely after it
_quiet_after_change = tuple(Expect(m) for m in (T - 1, *range(T, T + 25), T + 40, T + 80, T + 120, LONG))

NON_EVENTS_WORKLOADS: tuple[Scenario, ...] = (
    Scenario("rollout_without_change",
             "A rolling update of a two-pod Deployment with the same behaviour: each new pod warms up "
             "while an old one still runs, then the old one ends.",
             LONG, pods=_rollout, expect=_quiet_after_change),
    Scenario("scale_in_4_to_2",
             "A data-parallel job scales from 4 pods to 2 at unchanged per-pod rates.",
             LONG, pods=_four, expect=_quiet_after_change),
    Scenario("scale_out_2_to_4",
             "A data-parallel job scales from 2 pods to 4 at unchanged per-pod rates; the new pods warm up.",
             LONG, pods=_two_then_four,
             expect=_quiet_after_change),
    Scenario("new_run_same_job_label",
             "A job's two pods end and a new run with the same gpulens_job starts 5 minutes later "
             "(new pod names, warm-up, then the same behaviour).",
             LONG, pods=_run1 + _run2,
             expect=_quiet_after_change),
    Scenario("process_restart",
             "The trainer process restarts inside its pod (3 minutes without a process, then a "
             "warm-up at a fifth of its demand); the exporter keeps the pod's counters across the gap.",
             LONG, pods=(_restarted,),
             expect=_quiet_after_change),
)
# --- per worker (issue 29): 1, 2 and 8 torchrun workers per container -----------------------
# The same per-worker story told with 1, 2 and 8 workers in one container (each worker its own
# series, `rank`, on its own GPU): the same alert fires at the same minute, and per-worker noise
# that is under a floor for one worker stays silent for eight (the floors hold per worker, not
# per pod: 8 workers at 10 launches/s are not one pod at 80).
WORKER_COUNTS = (1, 2, 8)


def _per_worker(story: str, text: str, first: int | None, alert: str = "", diagnosis: str = "",
                **rates: Steps) -> tuple[Scenario, ...]:
    """One scenario per worker count; `first`: the minute the alert starts firing (silent the
    minute before), or None for a story that must stay silent throughout."""
    out = []
    for n in WORKER_COUNTS:
        pod = Pod("ml", f"{story.replace('_', '-')}-{n}w-0", workers=n, **rates)
        if first is None:
            expect = _quiet
        else:
            firing = (fires(alert, pod, diagnosis),)
            expect = (Expect(T - 10), Expect(T + 3), Expect(first - 1), Expect(first, firing),
                      Expect(first + 5, firing))
        out.append(Scenario(f"workers_{story}_{n}", f"{text} {n} worker{'s' if n > 1 else ''} per container.",
                            120 if first is None else 80, pods=(pod,), expect=expect))
    return tuple(out)


WORKER_FIRST = {"host_sync": T + 9, "device_slowdown": T + 10, "demand_drop": T + 15}

WORKERS: tuple[Scenario, ...] = (
    *_per_worker("host_sync", "Every worker starts copying tensors to the host each step: per worker, demand "
                 "flat, blocked share 0.30 -> 0.55, D2H 0.2 -> 40 MB/s.", WORKER_FIRST["host_sync"],
                 "GPUWorkloadHostSync", "host_sync", launches=change(LAUNCHES, T, 1950.0),
                 sync_wait=change(SYNC, T, 0.55), d2h=change(D2H, T, 40e6)),
    *_per_worker("device_slowdown", "The GPUs throttle: per worker, demand halves, blocked share 0.30 -> 0.70, "
                 "and D2H wobbles 0.2 -> 0.6 MB/s, under the 1 MB/s floor of one worker (summed over 8 "
                 "workers it would cross it and pass for a host sync).", WORKER_FIRST["device_slowdown"],
                 "GPUWorkloadDeviceSlowdown", "device_slowdown", launches=change(LAUNCHES, T, 1000.0),
                 sync_wait=change(SYNC, T, 0.7), h2d=change(H2D, T, 25e6), d2h=change(D2H, T, 0.6e6)),
    *_per_worker("demand_drop", "Demand halves per worker while each worker's small feed (0.8 MB/s, under the "
                 "1 MB/s floor) falls to 0.1 MB/s: unexplained, not input starvation (summed over 2 or 8 "
                 "workers the feed would cross the floor).", WORKER_FIRST["demand_drop"],
                 "GPUWorkloadDemandDrop", "unclassified", launches=change(LAUNCHES, T, 1000.0),
                 h2d=change(0.8e6, T, 0.1e6)),
    *_per_worker("tiny_noise", "Each worker launches 10 kernels/s, then 4, its blocked share wobbling "
                 "0.02 -> 0.045: under the 20 launches/s-per-worker minimum, nothing alerts, however many "
                 "workers share the container.", None,
                 launches=change(10.0, T, 4.0), sync_wait=change(0.02, T, 0.045)),
    Scenario("workers_recording", "Per-worker values of a pod with 8 workers: its sums are 8 times "
             "theirs; a worker blocked in two threads at once counts as fully blocked (a share of 1).", 10,
             pods=(Pod("ml", "eight-0", workers=8, sync_wait=flat(1.6)),),
             expect_samples=(
                 ExpectSamples(10, "namespace_pod:gpulens_workers:count",
                               ((f"namespace_pod:gpulens_workers:count{_labels(base=_eight)}", 8.0),)),
                 ExpectSamples(10, "round(namespace_pod:gpulens_launches:rate5m)",
                               ((_labels(base=_eight), 8 * LAUNCHES),)),
                 ExpectSamples(10, "round(namespace_pod:gpulens_launches_per_worker:rate5m)",
                               ((_labels(base=_eight), LAUNCHES),)),
                 ExpectSamples(10, "round(namespace_pod:gpulens_sync_wait_seconds:rate5m, 0.1)",
                               ((_labels(base=_eight), 12.8),)),
                 ExpectSamples(10, "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m",
                               ((f"namespace_pod:gpulens_sync_wait_seconds:avg_rate5m{_labels(base=_eight)}", 1.0),)),
                 ExpectSamples(10, 'namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m{direction="d2h"}',
                               ((f"namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m"
                                 f"{_labels({'direction': 'd2h'}, base=_eight)}", D2H),)),
             )),
)

WORKERS += (
    Scenario("workers_one_rank_exits",
             "Of a pod's two workers (one per GPU), one exits at minute 60 and the other runs on at its "
             "rate. The exporter keeps the exited worker's counters, flat, for --retired-ttl (30 minutes "
             "here): a series that stopped moving is not a worker, so the one left is not judged at half "
             "its rate.", 100,
             pods=(Pod("ml", "pair-0"), Pod("ml", "pair-0", gpu="1", end=T, retired_ttl=30)),
             expect=tuple(Expect(m) for m in (40, *range(T, T + 35, 2), 99))),
    Scenario("workers_recording_without_nvml", "8 workers in one container on a node without NVML: "
             "every series has gpu \"unknown\", and the rank still tells the workers apart.", 10, nvml=False,
             pods=(Pod("ml", "eight-0", gpu="unknown", workers=8),),
             expect_samples=(
                 ExpectSamples(10, "namespace_pod:gpulens_workers:count",
                               ((f"namespace_pod:gpulens_workers:count{_labels(base=_eight)}", 8.0),)),
                 ExpectSamples(10, "round(namespace_pod:gpulens_sync_wait_seconds:avg_rate5m, 0.01)",
                               ((_labels(base=_eight), SYNC),)),
             )),
)

ALL: tuple[Scenario, ...] = (INCIDENTS + NON_EVENTS + EXPORTER + RECORDING + WORKLOADS + NON_EVENTS_WORKLOADS
                             + WORKERS)


# --- the capture plane: agents and coordinators (docs/metrics.md) -------------------------------
_AGENT = {"job": "gpulens-system/gpulens-agent", "instance": "10.0.0.11:9451", "namespace": "gpulens-system",
          "pod": "gpulens-node-7xk2p"}
_COORD = {"job": "gpulens-system/gpulens-coordinator", "instance": "10.244.0.31:9452", "namespace": "ml",
          "pod": "gpulens-train-coordinator-5d9c"}


def _plane(name: str, base: dict[str, str], labels: dict[str, str], values: list[Value]) -> RawSeries:
    merged = {**base, **labels}
    return RawSeries(name + "{" + ", ".join(f'{k}="{v}"' for k, v in merged.items()) + "}", tuple(values))


def _targets(outcome: str, reason: str, per_minute: list[float]) -> RawSeries:
    """gpulens_coordinator_targets_total from the targets finished in each minute."""
    total, values = 0.0, []
    for n in per_minute:
        total += n
        values.append(total)
    return _plane("gpulens_coordinator_targets_total", _COORD, {"outcome": outcome, "reason": reason}, values)


def _every(n: int, minutes: int, start: int = 0, stop: int | None = None, count: float = 2.0) -> list[float]:
    """`count` targets every `n` minutes (a two-rank capture), in [start, stop)."""
    stop = minutes if stop is None else stop
    return [count if start <= m < stop and (m - start) % n == 0 else 0.0 for m in range(minutes + 1)]


def _plane_fires(alertname: str, base: dict[str, str]) -> tuple[str, dict[str, str]]:
    labels = dict(base) if alertname == "GPULensAgentDown" else {"namespace": base["namespace"], "pod": base["pod"]}
    return alertname, {**labels, "diagnosis": "capture_degraded"}


CAPTURE: tuple[Scenario, ...] = (
    Scenario("agent_down",
             "An agent is scraped for 10 minutes, then its scrape fails; the exporter's scrape never "
             "worked on this node (its own alerts cover it), and must not read as an agent.", 30,
             raw=(_plane("up", _AGENT, {}, [1.0] * 10 + [0.0] * 21),
                  _plane("up", {**_AGENT, "job": "gpulens-system/gpulens-exporter", "instance": "10.0.0.11:9450"},
                         {}, [0.0] * 31)),
             expect=(Expect(9), Expect(15), Expect(25, (_plane_fires("GPULensAgentDown", _AGENT),)))),
    Scenario("captures_failing",
             "A coordinator archives a two-rank capture every 5 minutes for 30 minutes; from then on "
             "every capture's ranks end trace_timeout (dynolog refused them). Failed targets outweigh "
             "the archived ones in the last hour after minute 60.", 90,
             raw=(_targets("archived", "", _every(5, 90, stop=30)),
                  _targets("failed", "trace_timeout", _every(5, 90, start=30)),
                  _targets("failed", "dynolog_lost", [0.0] * 91)),
             expect=(Expect(50), Expect(58),
                     Expect(80, (_plane_fires("GPULensCapturesFailing", _COORD),)))),
    Scenario("captures_mostly_archived",
             "Captures archive every 5 minutes; one rank of one capture fails (1 of 24 targets in the hour) "
             "and a second coordinator's only two-rank capture failed (too few targets to judge).", 60,
             raw=(_targets("archived", "", _every(5, 60)),
                  _targets("failed", "agent_unreachable", _every(60, 60, start=20, count=1.0)),
                  _plane("gpulens_coordinator_targets_total", {**_COORD, "pod": "gpulens-eval-coordinator-1"},
                         {"outcome": "failed", "reason": "not_registered"}, [0.0] * 10 + [2.0] * 51),
                  _plane("gpulens_coordinator_targets_total", {**_COORD, "pod": "gpulens-eval-coordinator-1"},
                         {"outcome": "archived", "reason": ""}, [0.0] * 61)),
             expect=(Expect(30), Expect(45), Expect(59))),
    Scenario("stalled_job_empty_traces",
             "A stalled job (issue 45): every 5 minutes a hang capture archives both ranks' evidence and "
             "its Kineto window ends both ranks trace_empty (blocked ranks write empty traces, kept as "
             "evidence), and every other window times out on a rank held in the GIL: the job's trouble, "
             "not the capture plane's; only trace_timeout here is a capture failing, and it stays under half.", 90,
             raw=(_targets("archived", "", _every(5, 90)),
                  _targets("failed", "trace_empty", _every(5, 90, count=4.0)),
                  _targets("failed", "trace_timeout", _every(10, 90, count=1.0))),
             expect=(Expect(30), Expect(60), Expect(89))),
)
