"""Alertmanager's webhook payload (version "4"), read strictly where it matters and loosely elsewhere.

Unknown fields are ignored (newer Alertmanagers add `notification_reason`, `routeLabels`, ...).
Per alert we need status, labels, startsAt and fingerprint: (fingerprint, startsAt) names one
alert episode and stays the same across Alertmanager's repeats, retries and the resolved
notification (reference/ecosystem-conventions.md, section 1). Group-level fields
(`commonLabels`) are never used: they are computed over a possibly truncated list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Alert", "PayloadError", "parse_payload", "AUTO_LABEL", "JOB_LABEL", "WORKLOAD_LABEL"]

AUTO_LABEL = "gpulens_capture"   # "auto": this alert asks for a trace capture; "hang": for a hang capture (issue 45)
CAPTURE_KINDS = {"auto": "trace", "hang": "hang"}
JOB_LABEL = "gpulens_job"        # the job id (GPULENS_JOB_ID); absent: route by namespace/pod
WORKLOAD_LABEL = "gpulens_workload"   # "Deployment/<name>", "job/<id>", ...: a serving kind makes replica captures
BUDGET_ANNOTATION = "gpulens_budget_mb"   # uncompressed trace MiB per rank for this alert's captures (1..65536)


class PayloadError(ValueError):
    """The body is not an Alertmanager v4 webhook payload; `.field` names what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str
    ends_at: str
    fingerprint: str

    @property
    def key(self) -> str:
        return f"{self.fingerprint}|{self.starts_at}"

    @property
    def wants_capture(self) -> bool:
        return self.labels.get(AUTO_LABEL) in CAPTURE_KINDS

    @property
    def capture_kind(self) -> str:
        """The capture the alert asks for: a trace, or (a stalled job) its hang evidence."""
        return CAPTURE_KINDS.get(self.labels.get(AUTO_LABEL, ""), "trace")


def _str_map(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(field, "must be an object of strings")
    return dict(value)


def parse_payload(data: Any) -> list[Alert]:
    if not isinstance(data, dict):
        raise PayloadError("", "the body must be a JSON object")
    if data.get("version") != "4":
        raise PayloadError("version", f"only webhook payload version \"4\" is understood, not {data.get('version')!r}")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts", "must be a list")
    out = []
    for i, a in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(a, dict):
            raise PayloadError(where, "must be an object")
        status = a.get("status")
        if status not in ("firing", "resolved"):
            raise PayloadError(f"{where}.status", f"must be firing or resolved, not {status!r}")
        for key in ("fingerprint", "startsAt"):
            if not isinstance(a.get(key), str) or not a[key] or len(a[key]) > 128:
                raise PayloadError(f"{where}.{key}", "must be a non-empty string")
        ends_at = a.get("endsAt", "")
        if not isinstance(ends_at, str):
            raise PayloadError(f"{where}.endsAt", "must be a string")
        out.append(Alert(status, _str_map(a.get("labels"), f"{where}.labels"),
                         _str_map(a.get("annotations"), f"{where}.annotations"), a["startsAt"], ends_at,
                         a["fingerprint"]))
    return out
