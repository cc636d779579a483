"""The two gpulens dashboards, declared as rows of panels, rendered with grafana-foundation-sdk.

    python -m gpulens.dashboards.build            # rewrite dashboards/json/*.json
    python -m gpulens.dashboards.build --check    # exit 1 if the committed JSON is stale

Conventions (reference/ecosystem-conventions.md §2): a `datasource` variable and no `__inputs`
(file and sidecar provisioning do not resolve them); stable uids, which the alerts' dashboard_url
annotations use; capture annotations from Grafana's tag query (tag `gpulens`), so organisation
annotations written by the coordinator show up whatever uid a dashboard was imported under.
Queries read only the exporter's catalogue (exporter/metrics.yaml), the recording rules in
alertrules/rules/, and Prometheus' own ALERTS series.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

from .panels import DATASOURCE, GRAFANA, CapturesSpec, PanelSpec, Query, Row, layout

__all__ = ["JSON_DIR", "DASHBOARDS", "CAPTURE_TAGS", "all_queries", "render", "main"]

JSON_DIR = Path(__file__).resolve().parent / "json"

#: Tags the coordinator puts on its capture annotations (docs/dashboards.md); the tag query ANDs them.
CAPTURE_TAGS = ("gpulens",)

POD = 'namespace=~"$namespace", gpulens_workload=~"$workload", pod=~"$pod"'
# the selected workloads (the key of the baselines: a new pod of the same workload inherits them)
WORKLOAD = 'namespace=~"$namespace", gpulens_workload=~"$workload"'
WL_LEGEND = "{{namespace}}/{{gpulens_workload}}"
NODE = 'node=~"$node", gpu=~"$gpu"'
# the GPUs the selected pods run on (NVML lists a process of theirs there)
POD_GPUS = f"group by (node, gpu) (gpulens_process_gpu_memory_bytes{{{POD}}})"


#: each worker's blocked share (series: container, gpu, rank), highest first
RANK_BLOCKED = ("sort_desc(clamp_max(sum by (namespace, pod, container, gpu, rank) ("
                f"rate(gpulens_sync_wait_seconds_total{{{POD}}}[$__rate_interval])), 1))")


def _on_pod_gpus(metric: str) -> str:
    return f"max by (node, gpu) ({metric}) * on (node, gpu) group_left () {POD_GPUS}"


def _with_baseline(title: str, description: str, current: str, baseline: str, unit: str,
                   legend: str = "{{namespace}}/{{pod}}", **kw) -> PanelSpec:
    """A pod's signal per worker and the baseline of its workload (per worker), which the alerts compare it with."""
    return PanelSpec(title, description, (
        Query(f"{current}{{{POD}}}", legend),
        Query(f"{baseline}{{{WORKLOAD}}}", WL_LEGEND + " baseline per worker"),
    ), unit=unit, **kw)


def _workload_now_vs_baseline(title: str, description: str, now: str, baseline: str, unit: str,
                              selector: str = "", **kw) -> PanelSpec:
    sel = f"{{{WORKLOAD}{', ' + selector if selector else ''}}}"
    suffix = " {{direction}}" if "direction" in selector else ""
    return PanelSpec(title, description, (
        Query(f"{now}{sel}", WL_LEGEND + suffix + " now"),
        Query(f"{baseline}{sel}", WL_LEGEND + suffix + " baseline"),
    ), unit=unit, **kw)


WORKLOAD_ROWS: tuple[Row, ...] = (
    Row("Workload: now vs baseline (per worker)", (
        _workload_now_vs_baseline(
            "Launches per second per worker",
            "The workload's demand per worker now (mean over its settled pods, live for 10 minutes, of "
            "each pod's launches divided among its workers) and the baseline "
            "every pod of the workload is judged against. The baseline is held while the workload is off "
            "it, for up to 1h after its 30-minute window runs out of normal samples (docs/alerts.md).",
            "namespace_workload:gpulens_launches_per_worker:rate5m",
            "namespace_workload:gpulens_launches_per_worker:baseline_rate5m", "ops"),
        _workload_now_vs_baseline(
            "Back-pressure (workload)",
            "Fraction of time a worker of the workload is blocked in synchronisation, now and baseline.",
            "namespace_workload:gpulens_sync_wait_seconds:avg_rate5m",
            "namespace_workload:gpulens_sync_wait_seconds:baseline_avg_rate5m", "percentunit", min=0),
        _workload_now_vs_baseline(
            "Transfers per worker (workload)",
            "Host-to-device and device-to-host bytes per second per worker, now and baseline.",
            "namespace_workload_direction:gpulens_memcpy_bytes_per_worker:rate5m",
            "namespace_workload_direction:gpulens_memcpy_bytes_per_worker:baseline_rate5m", "Bps",
            selector='direction=~"h2d|d2h"', min=0),
        PanelSpec("Pods: settled, and off the baseline",
                  "Settled pods of the workload (live 10 minutes: judged and counted), and 1 while some "
                  "settled pod is more than 20% off the baseline on some signal (the baseline then holds).",
                  (Query(f"count by (namespace, gpulens_workload) (namespace_pod:gpulens_live:settled{{{WORKLOAD}}})",
                         WL_LEGEND + " settled pods"),
                   Query(f"namespace_workload:gpulens_off_baseline:group{{{WORKLOAD}}}", WL_LEGEND + " off baseline")),
                  unit="short", min=0),
        _workload_now_vs_baseline(
            "Pods on the workload's GPUs",
            "Mean over its settled pods of the pods sharing each one's busiest GPU, now and baseline.",
            "namespace_workload:gpulens_gpu_pods:avg_max", "namespace_workload:gpulens_gpu_pods:baseline_avg_max",
            "short", min=0, width=24, height=6),
    )),
    Row("Demand", (
        _with_baseline("Launches per second per worker (demand)",
                       "Kernels per second of each pod divided among its workers (eBPF probes on libcuda): "
                       "kernels launched directly, kernels run through CUDA graphs, graph launches of unknown "
                       "size once each; and the baseline the alerts compare it against: its workload's "
                       "per-worker level before any change.",
                       "namespace_pod:gpulens_launches_per_worker:rate5m",
                       "namespace_workload:gpulens_launches_per_worker:baseline_rate5m", "ops"),
        PanelSpec("Demand relative to baseline",
                  "Current launches per second of each pod over its workload's baseline. The diagnosed "
                  "alerts fire below 0.6 (dashed line) for 5 minutes; empty while a pod is in its first "
                  "10 minutes, its workload has under 35 minutes of history or a baseline under 20 launches/s "
                  "per worker.",
                  (Query(f"namespace_pod:gpulens_launches_per_baseline:ratio_rate5m{{{POD}}}", "{{namespace}}/{{pod}}"),),
                  unit="percentunit", min=0, threshold=0.6),
        PanelSpec("Launches per second by GPU and kind",
                  "Kernel launches, graph launches, the kernels those graph launches ran, and graph "
                  "launches whose kernel count is unknown (graphs built before the exporter attached, "
                  "conditional nodes, updated graphs), per GPU.",
                  (Query(f"sum by (pod, gpu) (rate(gpulens_kernel_launches_total{{{POD}}}[$__rate_interval]))",
                         "{{pod}} gpu {{gpu}} kernels"),
                   Query(f"sum by (pod, gpu) (rate(gpulens_graph_launches_total{{{POD}}}[$__rate_interval]))",
                         "{{pod}} gpu {{gpu}} graphs"),
                   Query(f"sum by (pod, gpu) (rate(gpulens_graph_kernels_total{{{POD}}}[$__rate_interval]))",
                         "{{pod}} gpu {{gpu}} kernels in graphs"),
                   Query(f"sum by (pod, gpu) (rate(gpulens_graph_unknown_launches_total{{{POD}}}[$__rate_interval]))",
                         "{{pod}} gpu {{gpu}} graphs of unknown size")),
                  unit="ops", width=24),
    )),
    Row("Back-pressure", (
        _with_baseline("Back-pressure: fraction of time blocked",
                       "Seconds per second a worker's host threads spend blocked in cuCtxSynchronize, "
                       "cuStreamSynchronize, cuEventSynchronize and synchronous device-to-host copies "
                       "(mean over the pod's workers, each at most 1), with its baseline.",
                       "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m",
                       "namespace_workload:gpulens_sync_wait_seconds:baseline_avg_rate5m", "percentunit", min=0),
        PanelSpec("Which rank blocks most",
                  "Each worker's share of time blocked (rank: its LOCAL_RANK; gpu: its GPU), at most 1, "
                  "highest first: the rank a pod waits on. A worker without a rank shows as one per "
                  "container and GPU.",
                  (Query(RANK_BLOCKED, "{{pod}} rank {{rank}} gpu {{gpu}}", instant=True),),
                  kind="table", height=8),
        PanelSpec("Blocked share by rank",
                  "The same per-worker shares over time.",
                  (Query(RANK_BLOCKED, "{{pod}} rank {{rank}} gpu {{gpu}}"),),
                  unit="percentunit", min=0, height=8),
        PanelSpec("Blocking calls and mean wait",
                  "Blocking synchronisation calls per second, and the mean time one call blocks.",
                  (Query(f"namespace_pod:gpulens_sync_calls:rate5m{{{POD}}}", "{{pod}} calls/s"),
                   Query(f"namespace_pod:gpulens_sync_wait_seconds:rate5m{{{POD}}} / "
                         f"namespace_pod:gpulens_sync_calls:rate5m{{{POD}}}", "{{pod}} mean wait (s)")),
                  unit="short"),
        PanelSpec("Back-pressure unavailable on this node",
                  "A row here: the exporter on that node found return probes unsafe on its kernel (a "
                  "seccomp-filtered process would be killed), so blocked time is not measured there and "
                  "the panels above are empty for its pods; the reason says why.",
                  (Query(f"node:gpulens_back_pressure_unavailable:info and on (node) "
                         f"namespace_pod:gpulens_launches:rate5m{{{POD}}}", instant=True),),
                  kind="table", width=24, height=4),
    )),
    Row("Contention", (
        _with_baseline("Pods on this pod's GPU",
                       "Distinct pods with a process on the busiest GPU this pod uses (NVML), and the "
                       "baseline. Rising above the baseline together with a demand drop is the "
                       "noisy_neighbor diagnosis.",
                       "namespace_pod:gpulens_gpu_pods:max", "namespace_workload:gpulens_gpu_pods:baseline_avg_max",
                       "short", min=0),
        PanelSpec("Processes on these pods' GPUs",
                  "Processes per GPU (all pods) on the GPUs the selected pods use.",
                  (Query(_on_pod_gpus("gpulens_gpu_processes"), "{{node}} gpu {{gpu}}"),), unit="short", min=0),
    )),
    Row("Transfers", (
        PanelSpec("Host-to-device bytes per second per worker",
                  "cuMemcpyHtoD* bytes (sync and async) per worker of the pod, with the baseline. A collapse below half "
                  "the baseline with a demand drop is the input_starvation diagnosis.",
                  (Query(f'namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m{{direction="h2d", {POD}}}', "{{pod}}"),
                   Query(f'namespace_workload_direction:gpulens_memcpy_bytes_per_worker:baseline_rate5m{{direction="h2d", {WORKLOAD}}}',
                         WL_LEGEND + " baseline per worker")), unit="Bps", min=0),
        PanelSpec("Device-to-host bytes per second per worker",
                  "cuMemcpyDtoH* bytes (sync and async) per worker of the pod, with the baseline. A rise together with "
                  "back-pressure is the signature of host_sync.",
                  (Query(f'namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m{{direction="d2h", {POD}}}', "{{pod}}"),
                   Query(f'namespace_workload_direction:gpulens_memcpy_bytes_per_worker:baseline_rate5m{{direction="d2h", {WORKLOAD}}}',
                         WL_LEGEND + " baseline per worker")), unit="Bps", min=0),
        PanelSpec("Copy calls per second",
                  "Host/device copy calls by direction.",
                  (Query(f"sum by (pod, direction) (rate(gpulens_memcpy_calls_total{{{POD}}}[$__rate_interval]))",
                         "{{pod}} {{direction}}"),), unit="ops", width=24, height=6),
    )),
    Row("Memory and utilisation (NVML)", (
        PanelSpec("GPU memory used",
                  "GPU memory used by the pod's processes, per GPU.",
                  (Query(f"sum by (pod, gpu) (gpulens_process_gpu_memory_bytes{{{POD}}})", "{{pod}} gpu {{gpu}}"),),
                  unit="bytes", min=0),
        PanelSpec("SM utilisation of the pod's processes",
                  "Most recent NVML per-process SM utilisation sample. It looks normal in all three "
                  "incidents; that is why demand, back-pressure and contention exist.",
                  (Query(f"max by (pod, gpu) (gpulens_process_gpu_utilization_ratio{{{POD}}})", "{{pod}} gpu {{gpu}}"),),
                  unit="percentunit", min=0, max=1),
    )),
    Row("Device activity (DCGM) on these pods' GPUs", (
        PanelSpec("GPU utilisation and SM active",
                  "DCGM device counters of the GPUs the selected pods use (whoever else runs there).",
                  (Query(_on_pod_gpus("gpulens_dcgm_gpu_utilization_ratio"), "{{node}} gpu {{gpu}} util"),
                   Query(_on_pod_gpus("gpulens_dcgm_sm_active_ratio"), "{{node}} gpu {{gpu}} SM active")),
                  unit="percentunit", min=0, max=1, width=8),
        PanelSpec("Power and temperature",
                  "Board power (W) and GPU temperature (°C).",
                  (Query(_on_pod_gpus("gpulens_dcgm_power_watts"), "{{node}} gpu {{gpu}} W"),
                   Query(_on_pod_gpus("gpulens_dcgm_temperature_celsius"), "{{node}} gpu {{gpu}} °C")),
                  unit="short", width=8),
        PanelSpec("PCIe bytes per second",
                  "PCIe traffic by direction (DCGM profiling counters).",
                  (Query(f"sum by (node, gpu, direction) (rate(gpulens_dcgm_pcie_bytes_total[$__rate_interval])) "
                         f"* on (node, gpu) group_left () {POD_GPUS}", "{{node}} gpu {{gpu}} {{direction}}"),),
                  unit="Bps", min=0, width=8),
    )),
    Row("Alerts and captures", (
        PanelSpec("Firing gpulens alerts",
                  "Diagnosed alerts firing now for the selected pods (Prometheus ALERTS series).",
                  (Query(f'ALERTS{{alertstate="firing", diagnosis!="", {POD}}}', instant=True),),
                  kind="table", width=24, height=6),
        CapturesSpec("Captures and their reports",
                     "Capture annotations written by the coordinator (tag gpulens); each text links to "
                     "the capture's analysis report and manifest. Click one to jump to its time.",
                     CAPTURE_TAGS),
    )),
)

NODE_ROWS: tuple[Row, ...] = (
    Row("Contention", (
        PanelSpec("Pods per GPU", "Distinct pods with a process on each GPU (NVML).",
                  (Query(f"max by (node, gpu) (gpulens_gpu_pods{{{NODE}}})", "{{node}} gpu {{gpu}}"),),
                  unit="short", min=0),
        PanelSpec("Processes per GPU", "Processes on each GPU (NVML).",
                  (Query(f"max by (node, gpu) (gpulens_gpu_processes{{{NODE}}})", "{{node}} gpu {{gpu}}"),),
                  unit="short", min=0),
    )),
    Row("Demand and back-pressure by pod", (
        PanelSpec("Launches per second by pod", "Kernel launches per second of each pod on each GPU.",
                  (Query(f"sum by (gpu, namespace, pod) (rate(gpulens_kernel_launches_total{{{NODE}}}[$__rate_interval]))",
                         "gpu {{gpu}} {{namespace}}/{{pod}}"),), unit="ops", stack=True),
        PanelSpec("Seconds blocked per second by pod", "Host time blocked in synchronisation, per pod and GPU.",
                  (Query(f"sum by (gpu, namespace, pod) (rate(gpulens_sync_wait_seconds_total{{{NODE}}}[$__rate_interval]))",
                         "gpu {{gpu}} {{namespace}}/{{pod}}"),), unit="short", min=0),
    )),
    Row("Transfers and memory", (
        PanelSpec("Host/device bytes per second", "cuMemcpy bytes per GPU by direction (all pods).",
                  (Query(f"sum by (gpu, direction) (rate(gpulens_memcpy_bytes_total{{{NODE}}}[$__rate_interval]))",
                         "gpu {{gpu}} {{direction}}"),), unit="Bps", min=0),
        PanelSpec("GPU memory by pod", "GPU memory used by each pod's processes (NVML).",
                  (Query(f"sum by (gpu, namespace, pod) (gpulens_process_gpu_memory_bytes{{{NODE}}})",
                         "gpu {{gpu}} {{namespace}}/{{pod}}"),), unit="bytes", min=0, stack=True),
    )),
    Row("Device (DCGM)", (
        PanelSpec("GPU utilisation and SM active", "DCGM_FI_DEV_GPU_UTIL and DCGM_FI_PROF_SM_ACTIVE.",
                  (Query(f"max by (node, gpu) (gpulens_dcgm_gpu_utilization_ratio{{{NODE}}})", "gpu {{gpu}} util"),
                   Query(f"max by (node, gpu) (gpulens_dcgm_sm_active_ratio{{{NODE}}})", "gpu {{gpu}} SM active")),
                  unit="percentunit", min=0, max=1, width=8),
        PanelSpec("Framebuffer memory used", "DCGM_FI_DEV_FB_USED.",
                  (Query(f"max by (node, gpu) (gpulens_dcgm_memory_used_bytes{{{NODE}}})", "gpu {{gpu}}"),),
                  unit="bytes", min=0, width=8),
        PanelSpec("Power and temperature", "Board power (W) and GPU temperature (°C).",
                  (Query(f"max by (node, gpu) (gpulens_dcgm_power_watts{{{NODE}}})", "gpu {{gpu}} W"),
                   Query(f"max by (node, gpu) (gpulens_dcgm_temperature_celsius{{{NODE}}})", "gpu {{gpu}} °C")),
                  unit="short", width=8),
        PanelSpec("PCIe bytes per second", "PCIe traffic by direction (tx, rx).",
                  (Query(f"sum by (gpu, direction) (rate(gpulens_dcgm_pcie_bytes_total{{{NODE}}}[$__rate_interval]))",
                         "gpu {{gpu}} {{direction}}"),), unit="Bps", min=0, width=24, height=6),
    )),
    Row("Exporter health", (
        PanelSpec("Sources", "1 when a source (ebpf, nvml, dcgm, attribution) works; the table below says why not.",
                  (Query('max by (node, source) (gpulens_exporter_source_up{node=~"$node"})', "{{node}} {{source}}"),),
                  unit="short", min=0, max=1, width=8),
        PanelSpec("Probes, libraries, processes", "Uprobes and driver libraries attached, processes tracked.",
                  (Query('max by (node) (gpulens_exporter_probes_attached{node=~"$node"})', "{{node}} probes"),
                   Query('max by (node) (gpulens_exporter_libraries_attached{node=~"$node"})', "{{node}} libraries"),
                   Query('max by (node) (gpulens_exporter_tracked_processes{node=~"$node"})', "{{node}} processes")),
                  unit="short", min=0, width=8),
        PanelSpec("BPF map fill", "Entries over capacity per BPF map; a full map stops counting new processes.",
                  (Query('max by (node, map) (gpulens_exporter_map_entries{node=~"$node"} / '
                         '(gpulens_exporter_map_capacity{node=~"$node"} > 0))', "{{node}} {{map}}"),),
                  unit="percentunit", min=0, max=1, threshold=0.9, width=8),
        PanelSpec("Errors per second", "Collection errors by source, failed uprobe attachments, failed BPF map updates.",
                  (Query('sum by (node, source) (rate(gpulens_exporter_source_errors_total{node=~"$node"}[$__rate_interval]))',
                         "{{node}} {{source}}"),
                   Query('sum by (node) (rate(gpulens_exporter_probe_attach_errors_total{node=~"$node"}[$__rate_interval]))',
                         "{{node}} attach errors"),
                   Query('sum by (node, map) (rate(gpulens_exporter_map_update_failures_total{node=~"$node"}[$__rate_interval]))',
                         "{{node}} {{map}} update failures")), unit="short", min=0, width=8),
        PanelSpec("Scrape duration", "Time the previous scrape took to collect every source.",
                  (Query('max by (node) (gpulens_exporter_scrape_duration_seconds{node=~"$node"})', "{{node}}"),),
                  unit="s", min=0, width=8),
        PanelSpec("Back-pressure unavailable", "Nodes whose exporter turned return probes off (safety gate: "
                  "unsafe on the kernel), so back-pressure is unavailable there; with the reason.",
                  (Query('node:gpulens_back_pressure_unavailable:info{node=~"$node"}', instant=True),),
                  kind="table", width=8),
        PanelSpec("Why sources are in their state", "gpulens_exporter_source_info: state and reason per source.",
                  (Query('gpulens_exporter_source_info{node=~"$node"}', instant=True),),
                  kind="table", width=8),
    )),
)


def _datasource_var() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def _query_var(name: str, query: str, label: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .include_all(True).all_value(".*").multi(True))


def _captures_annotation() -> db.AnnotationQuery:
    return (db.AnnotationQuery().name("gpulens captures").datasource(GRAFANA).enable(True).hide(False)
            .icon_color("purple")
            .target(db.AnnotationTarget().type("tags").tags(list(CAPTURE_TAGS)).match_any(False).limit(100)))


def _alerts_annotation(selector: str) -> db.AnnotationQuery:
    """Diagnosed alerts as regions on every time series (Prometheus annotation query)."""
    return (db.AnnotationQuery().name("gpulens alerts").datasource(DATASOURCE).enable(True).hide(False)
            .icon_color("red").expr(f'ALERTS{{alertstate="firing", diagnosis!="", {selector}}}'))


def _base(uid: str, title: str, description: str) -> db.Dashboard:
    return (db.Dashboard(title).uid(uid).description(description).tags(["gpulens", "gpu"])
            .editable().refresh("30s").time("now-3h", "now").timezone("browser")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR))


def workload_dashboard() -> db.Dashboard:
    d = (_base("gpulens-workload", "gpulens / Workload",
               "Per-workload baselines and per-pod GPU demand, back-pressure, contention, transfers, memory "
               "and device activity; diagnosed alerts and capture annotations linking to their reports.")
         .with_variable(_datasource_var())
         .with_variable(_query_var("namespace", "label_values(gpulens_kernel_launches_total, namespace)", "Namespace"))
         .with_variable(_query_var("workload", 'label_values(gpulens_kernel_launches_total{namespace=~"$namespace"}, gpulens_workload)',
                                   "Workload"))
         .with_variable(_query_var("pod", 'label_values(gpulens_kernel_launches_total{namespace=~"$namespace", '
                                          'gpulens_workload=~"$workload"}, pod)', "Pod"))
         .annotation(_captures_annotation())
         .annotation(_alerts_annotation(POD))
         .link(db.DashboardLink("gpulens dashboards").type(dm.DashboardLinkType.DASHBOARDS).tags(["gpulens"])
               .as_dropdown(True).include_vars(False).keep_time(True)))
    return layout(d, WORKLOAD_ROWS)


def node_dashboard() -> db.Dashboard:
    d = (_base("gpulens-node", "gpulens / Node GPUs",
               "Per-GPU contention, demand and transfers by pod, DCGM device counters and the exporter's own health.")
         .with_variable(_datasource_var())
         .with_variable(_query_var("node", "label_values(gpulens_gpu_pods, node)", "Node"))
         .with_variable(_query_var("gpu", 'label_values(gpulens_gpu_pods{node=~"$node"}, gpu)', "GPU"))
         .annotation(_captures_annotation())
         .annotation(_alerts_annotation('node=~"$node"'))
         .link(db.DashboardLink("gpulens dashboards").type(dm.DashboardLinkType.DASHBOARDS).tags(["gpulens"])
               .as_dropdown(True).include_vars(False).keep_time(True)))
    return layout(d, NODE_ROWS)


#: file name -> (builder, rows)
DASHBOARDS = {
    "gpulens-workload.json": (workload_dashboard, WORKLOAD_ROWS),
    "gpulens-node-gpus.json": (node_dashboard, NODE_ROWS),
}


def to_dict(dashboard: db.Dashboard) -> dict[str, Any]:
    data = json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))
    for var in data.get("templating", {}).get("list", []):
        var.pop("id", None)  # the SDK writes an all-zero uuid; Grafana keys variables by name
    return data


def render() -> dict[str, str]:
    return {name: json.dumps(to_dict(build()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            for name, (build, _) in DASHBOARDS.items()}


def all_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel query, variable query and annotation query."""
    out: list[tuple[str, str]] = []
    for name, (build, rows) in DASHBOARDS.items():
        for row in rows:
            for spec in row.panels:
                if isinstance(spec, PanelSpec):
                    out += [(f"{name}: {spec.title}", q.expr) for q in spec.queries]
        data = to_dict(build())
        for var in data["templating"]["list"]:
            if var["type"] == "query":
                out.append((f"{name}: variable {var['name']}", var["query"]))
        for ann in data["annotations"]["list"]:
            if ann.get("expr"):
                out.append((f"{name}: annotation {ann['name']}", ann["expr"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpulens.dashboards.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=JSON_DIR)
    p.add_argument("--check", action="store_true", help="compare with the JSON in --out, write nothing")
    args = p.parse_args(argv)
    files = render()
    stale = [n for n, text in files.items()
             if not (args.out / n).is_file() or (args.out / n).read_text() != text]
    if args.check:
        for n in stale:
            print(f"stale: {args.out / n} (run python -m gpulens.dashboards.build)", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n, text in files.items():
        (args.out / n).write_text(text)
        print(f"wrote {args.out / n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
