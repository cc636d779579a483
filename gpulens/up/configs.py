"""Configuration files that `gpulens up` generates for the system Prometheus and Alertmanager.

Intervals are short (seconds, not minutes) because the embedded default exists to show the whole
loop within minutes on one machine; the cluster values live in the Helm chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["prometheus_config", "alertmanager_config", "write_yaml", "AGENT_JOB", "AGENT_LABELS", "COORDINATOR_JOB"]

# the chart's PodMonitors are <namespace>/<release>-agent and -coordinator; these match the same rules
AGENT_JOB, COORDINATOR_JOB = "gpulens-agent", "gpulens-coordinator"
# `up` has no namespaces of its own: its agent is labelled as one pod of a "gpulens-up" namespace
AGENT_LABELS = {"namespace": "gpulens-up", "pod": "agent"}


def prometheus_config(*, exporter: str, rule_files: list[Path], alertmanager: str, agent: str | None = None,
                      coordinators_file: Path | None = None, scrape_interval_s: int = 2,
                      evaluation_interval_s: int = 2) -> dict[str, Any]:
    """Scrape the exporter and, as the chart's PodMonitors do, the capture plane: the agent at a fixed
    port, the coordinators (ports assigned as jobs register) from a file_sd file `up` rewrites.

    Job names match what the capture alerts select (`up{job=~".*gpulens.*agent.*"}`); the targets
    carry `namespace`/`pod` as a PodMonitor's do, since GPULensCapturesFailing sums by them."""
    scrape: list[dict[str, Any]] = [{
        "job_name": "gpulens-exporter",
        "scrape_interval": f"{scrape_interval_s}s",
        "static_configs": [{"targets": [exporter]}],
    }]
    if agent:
        scrape.append({"job_name": AGENT_JOB, "static_configs": [{"targets": [agent], "labels": dict(AGENT_LABELS)}]})
    if coordinators_file is not None:
        # file_sd watches the file (inotify); the refresh is the fallback where that is not delivered
        scrape.append({"job_name": COORDINATOR_JOB, "file_sd_configs": [{
            "files": [str(coordinators_file)], "refresh_interval": f"{max(5, scrape_interval_s)}s"}]})
    return {
        "global": {"scrape_interval": f"{scrape_interval_s}s", "evaluation_interval": f"{evaluation_interval_s}s",
                   "external_labels": {"gpulens": "embedded"}},
        "rule_files": [str(p) for p in rule_files],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": scrape,
    }


def alertmanager_config(*, webhook_url: str, token_file: Path, group_wait_s: int = 1,
                        group_interval_s: int = 5, repeat_interval: str = "1h") -> dict[str, Any]:
    """Auto-capture alerts go to the gateway (bearer token from a file); everything else nowhere."""
    return {
        "route": {
            "receiver": "null",
            "group_by": ["alertname", "namespace", "gpulens_job"],
            "group_wait": f"{group_wait_s}s",
            "group_interval": f"{group_interval_s}s",
            "repeat_interval": repeat_interval,
            "routes": [{
                "receiver": "gpulens-gateway",
                "matchers": ['gpulens_capture=~"auto|hang"'],
                "continue": False,
            }],
        },
        "receivers": [
            {"name": "null"},
            {"name": "gpulens-gateway", "webhook_configs": [{
                "url": webhook_url,
                "send_resolved": True,
                "max_alerts": 0,
                "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(token_file)}},
            }]},
        ],
    }


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
