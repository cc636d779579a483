"""Prometheus and Alertmanager outside the cluster, configured as a user of the chart without the
Prometheus Operator would configure them (README, "Prometheus without the Operator").

Prometheus finds the node DaemonSet's pods through the API's pod discovery, as a ServiceAccount
that may only read pods; it loads the project's alert rules (time-scaled the way `gpulens up`
scales them, so an incident is diagnosed in minutes), and sends alerts to an Alertmanager whose
webhook receiver is the gateway Service, authenticated with the gateway token. The cluster tests
(tests/cluster/test_5_alerts.py) run exactly these configs; the README shows their output. Debian's
Prometheus lacks Kubernetes discovery, so the tests swap `kubernetes_sd_configs` for
`http_sd_configs` on cluster/pod_sd.py, which answers the same targets and `__meta_kubernetes_pod_*`
labels; the relabelling, rules and Alertmanager config are the same.

    python cluster/monitoring.py rbac                        # the ServiceAccount + read-only RBAC (YAML)
    python cluster/monitoring.py config --out DIR \\
        --token-file T --ca-file CA --gateway-url http://10.96.0.20:9453 --gateway-token-file G \\
        --alertmanager 127.0.0.1:9093                        # DIR/{prometheus,alertmanager}.yml, DIR/rules/
    ... --pod-sd-url http://127.0.0.1:9095                   # Debian's Prometheus: discovery via cluster/pod_sd.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

if __package__ in (None, ""):                  # run as a script: the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulens.alertrules.generate import render as render_rules  # noqa: E402
from gpulens.up.configs import alertmanager_config as up_alertmanager_config  # noqa: E402

__all__ = ["Monitoring", "rbac", "scrape_configs", "prometheus_config", "alertmanager_config", "write_rules",
           "write_configs", "DEFAULT_TIME_SCALE", "WEBHOOK_PATH"]

#: `gpulens up`'s default: 30 minutes of rule time become 60 s (baselines in ~2 min, `for: 5m` in 10 s).
DEFAULT_TIME_SCALE = 1 / 30
WEBHOOK_PATH = "/v1/alertmanager"
#: Where the ServiceAccount lives, and the names of it and its RBAC.
SA_NAMESPACE, SA_NAME = "gpulens-monitoring", "prometheus"


@dataclass(frozen=True)
class Monitoring:
    """Everything the two configs point at."""

    token_file: Path                 # the ServiceAccount's token (from its Secret)
    ca_file: Path                    # the cluster CA, to trust the API server
    gateway_url: str                 # the gateway Service: http://<clusterIP>:<port>
    gateway_token_file: Path         # the chart's tokens Secret, key "gateway"
    alertmanager: str                # host:port Prometheus sends alerts to
    rule_files: tuple[Path, ...] = ()
    api_server: str = "https://10.244.0.1:6443"
    namespaces: tuple[str, ...] = ("gpulens-system",)   # the release's namespace(s)
    release: str = "gl"                                 # app.kubernetes.io/instance of the chart's pods
    scrape_interval_s: int = 2
    evaluation_interval_s: int = 2
    #: None: `kubernetes_sd_configs` (what a user writes). A URL: `http_sd_configs` on
    #: cluster/pod_sd.py there, for Debian's Prometheus, which has no Kubernetes discovery.
    pod_sd_url: str | None = None
    external_labels: dict[str, str] = field(default_factory=lambda: {"gpulens": "cluster-test"})


def rbac(namespace: str = SA_NAMESPACE, name: str = SA_NAME) -> list[dict[str, Any]]:
    """Prometheus's identity: a ServiceAccount that may get/list/watch pods, and nothing else
    (pod discovery needs no more). On 1.20 the token controller makes its token Secret."""
    meta = {"name": name, "labels": {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/part-of": "gpulens"}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {**meta, "name": f"gpulens-{name}"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {**meta, "name": f"gpulens-{name}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"gpulens-{name}"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def _pod_job(m: Monitoring, job: str, port_name: str, *, honor_labels: bool) -> dict[str, Any]:
    """One scrape job over the chart's node DaemonSet pods, one target per pod and container port."""
    if m.pod_sd_url is None:
        sd = {"kubernetes_sd_configs": [{
            "role": "pod", "api_server": m.api_server, "namespaces": {"names": list(m.namespaces)},
            "authorization": {"credentials_file": str(m.token_file)}, "tls_config": {"ca_file": str(m.ca_file)}}]}
    else:
        sd = {"http_sd_configs": [{"url": f"{m.pod_sd_url.rstrip('/')}/v1/pods?namespace={ns}",
                                   "refresh_interval": "5s"} for ns in m.namespaces]}
    return {
        "job_name": job,
        "scrape_interval": f"{m.scrape_interval_s}s",
        # The exporter's series name the TRAINER's namespace, pod, container and node: those must
        # win over the target's own labels (without this they become exported_namespace, ...).
        "honor_labels": honor_labels,
        **sd,
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name",
                               "__meta_kubernetes_pod_label_app_kubernetes_io_instance",
                               "__meta_kubernetes_pod_label_app_kubernetes_io_component"],
             "regex": f"gpulens;{m.release};node", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port_name, "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_node_name", "__meta_kubernetes_pod_container_port_number"],
             "separator": ":", "target_label": "instance"},
            {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "kubernetes_namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "kubernetes_pod"},
        ],
    }


def scrape_configs(m: Monitoring) -> list[dict[str, Any]]:
    """The exporter (container port `metrics`) and the agent's own /metrics (port `agent`; its job
    name matches GPULensAgentDown's `job=~".*gpulens.*agent.*"`)."""
    return [_pod_job(m, "gpulens-exporter", "metrics", honor_labels=True),
            _pod_job(m, "gpulens-agent", "agent", honor_labels=False)]


def prometheus_config(m: Monitoring) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{m.scrape_interval_s}s", "evaluation_interval": f"{m.evaluation_interval_s}s",
                   "external_labels": dict(m.external_labels)},
        "rule_files": [str(p) for p in m.rule_files],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [m.alertmanager]}]}]},
        "scrape_configs": scrape_configs(m),
    }


def alertmanager_config(m: Monitoring) -> dict[str, Any]:
    """`gpulens up`'s routing (auto-capture alerts to the gateway, the rest nowhere), with the
    gateway Service as the receiver."""
    return up_alertmanager_config(webhook_url=m.gateway_url.rstrip("/") + WEBHOOK_PATH, token_file=m.gateway_token_file)


def write_rules(out: Path, time_scale: float = DEFAULT_TIME_SCALE) -> tuple[Path, ...]:
    """The project's rule files, time-scaled by gpulens.alertrules.generate (what `gpulens up` loads)."""
    _, plain = render_rules(time_scale=time_scale, grafana_url="")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in sorted(plain.items()):
        (out / name).write_text(text)
        paths.append(out / name)
    return tuple(paths)


def dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=110, default_flow_style=None)


def write_configs(out: Path, m: Monitoring) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    prom, am = out / "prometheus.yml", out / "alertmanager.yml"
    prom.write_text(dump(prometheus_config(m)))
    am.write_text(dump(alertmanager_config(m)))
    return prom, am


#: The README's example ("Prometheus without the Operator"): where a user's Prometheus keeps the
#: ServiceAccount's token and CA, the gateway Service's ClusterIP, the gateway token file.
README_EXAMPLE = dict(token_file=Path("/etc/prometheus/gpulens/sa-token"), ca_file=Path("/etc/prometheus/gpulens/ca.crt"),
                      gateway_url="http://10.96.0.20:9453", gateway_token_file=Path("/etc/alertmanager/gpulens-gateway-token"),
                      alertmanager="127.0.0.1:9093", api_server="https://10.244.0.1:6443",
                      namespaces=("gpulens-system",), release="gl")


def readme_blocks() -> dict[str, str]:
    """The README's YAML blocks, rendered by the functions the cluster tests run."""
    m = Monitoring(**README_EXAMPLE)
    return {"scrape": dump({"scrape_configs": scrape_configs(m)}), "alertmanager": dump(alertmanager_config(m))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cluster/monitoring.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("readme", help="print the README's scrape config and Alertmanager config")
    r = sub.add_parser("rbac", help="print the ServiceAccount and its read-only RBAC as YAML")
    r.add_argument("--namespace", default=SA_NAMESPACE)
    c = sub.add_parser("config", help="write prometheus.yml, alertmanager.yml and rules/ into --out")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--token-file", type=Path, required=True, help="the ServiceAccount's token")
    c.add_argument("--ca-file", type=Path, required=True, help="the cluster CA certificate")
    c.add_argument("--gateway-url", required=True, help="the gateway Service, http://<clusterIP>:<port>")
    c.add_argument("--gateway-token-file", type=Path, required=True, help="the tokens Secret's key 'gateway'")
    c.add_argument("--alertmanager", required=True, help="host:port of the Alertmanager")
    c.add_argument("--api-server", default=Monitoring.api_server)
    c.add_argument("--namespace", action="append", help="the release's namespace (repeatable)")
    c.add_argument("--release", default=Monitoring.release)
    c.add_argument("--pod-sd-url", help="use cluster/pod_sd.py at this URL instead of kubernetes_sd_configs "
                   "(Debian's Prometheus has no Kubernetes discovery)")
    c.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="multiply every rule window by this")
    a = p.parse_args(argv)
    if a.cmd == "readme":
        for name, text in readme_blocks().items():
            sys.stdout.write(f"# {name}\n{text}")
        return 0
    if a.cmd == "rbac":
        sys.stdout.write("---\n".join(dump(d) for d in rbac(a.namespace)))
        return 0
    rules = write_rules(a.out / "rules", a.time_scale)
    m = Monitoring(token_file=a.token_file, ca_file=a.ca_file, gateway_url=a.gateway_url,
                   gateway_token_file=a.gateway_token_file, alertmanager=a.alertmanager, rule_files=rules,
                   api_server=a.api_server, namespaces=tuple(a.namespace or Monitoring.namespaces), release=a.release,
                   pod_sd_url=a.pod_sd_url)
    for path in write_configs(a.out, m):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
