"""What the gateway does with an alert or a person's request (no HTTP here; server.py adapts it).

Firing alert with `gpulens_capture="auto"` (a trace) or `"hang"` (a hang capture) -> route by (namespace, gpulens_job) or (namespace,
pod) -> per-job cooldown -> forward to the job's coordinator with a capture id assigned here and
recorded first, so every retry of the same episode carries the same id and starts nothing new.
Resolved alert -> tell the coordinator, which updates the capture's annotation.

Each outcome says whether a retry could change it (`retryable`): only then does Alertmanager
get a 5xx (reference/ecosystem-conventions.md 1.2: 5xx is retried, 4xx is not).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from gpulens.capture.client.api import ApiError, ApiUnavailable, CaptureApi
from gpulens.capture.models import CaptureReason, CaptureRequest, new_capture_id
from gpulens.capture.schemas import SchemaError
from gpulens.ground.logs import get_logger

from .alertmanager import BUDGET_ANNOTATION, JOB_LABEL, WORKLOAD_LABEL, Alert
from .ledger import AlertEntry, CaptureEntry, Ledger, cooldown_key
from .routing import Route, Router, Unroutable, deployment_revision, serving_kind

__all__ = ["ALERT_ACTIVITIES", "GatewaySettings", "Outcome", "Gateway"]

log = get_logger("gateway")


#: What an alert-started capture asks Kineto for: the GPU timeline HTA needs (kernels, copies,
#: runtime calls) plus CPU ops; all among the 12 names every Kineto knows, so a CPU-only trainer
#: simply records no GPU rows. No stacks or python_function: cheaper traces while it is slow.
ALERT_ACTIVITIES = ("cpu_op", "user_annotation", "gpu_user_annotation", "gpu_memcpy", "gpu_memset", "kernel",
                    "cuda_runtime", "cpu_instant_event")


@dataclass(frozen=True)
class GatewaySettings:
    """`iterations` > 0: alert-started captures are iteration-aligned (N optimizer steps from one
    iteration on every rank, within `duration_ms`); a process that never steps gets Kineto's short
    time trace instead, marked `stepped: false` in the manifest. 0: a wall-clock window of
    `duration_ms`. Manual captures ask for what they ask for."""

    cooldown_s: float = 600.0
    duration_ms: int = 2000
    activities: tuple[str, ...] = ALERT_ACTIVITIES
    iterations: int = 0
    iteration_roundup: int | None = None   # None: the coordinator's default
    # Serving workloads (alert label gpulens_workload="Deployment/...", StatefulSet, LeaderWorkerSet):
    # a wall-clock window of the alerted pod plus this many healthy peers of its revision.
    serving_peers: int = 1
    serving_duration_ms: int = 2000


@dataclass
class Outcome:
    fingerprint: str
    starts_at: str
    outcome: str
    capture_id: str | None = None
    detail: str | None = None
    retryable: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _is_dns_failure(exc: BaseException) -> bool:
    cause = exc.__cause__
    return isinstance(cause, getattr(aiohttp, "ClientConnectorDNSError", ())) if cause else False


class Gateway:
    def __init__(self, settings: GatewaySettings, router: Router, ledger: Ledger, api_for: Callable[[str], CaptureApi]):
        self.settings, self.router, self.ledger, self.api_for = settings, router, ledger, api_for
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    # --- Alertmanager ------------------------------------------------------------------------

    async def handle_alerts(self, alerts: list[Alert]) -> list[Outcome]:
        return list(await asyncio.gather(*(self._one(a) for a in alerts)))

    async def _one(self, alert: Alert) -> Outcome:
        if not alert.wants_capture:
            return Outcome(alert.fingerprint, alert.starts_at, "ignored",
                           detail="no gpulens_capture=\"auto\" or \"hang\" label")
        try:
            job = alert.labels.get(JOB_LABEL) or deployment_revision(alert.labels.get(WORKLOAD_LABEL),
                                                                     alert.labels.get("pod"))
            route = self.router.resolve(alert.labels.get("namespace"), job, alert.labels.get("pod"))
        except Unroutable as exc:
            log.warning("alert.unroutable", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"),
                        detail=str(exc))
            return Outcome(alert.fingerprint, alert.starts_at, "unroutable", detail=str(exc))
        async with self._lock(route.key):
            if alert.status == "firing":
                return await self._firing(alert, route)
            return await self._resolved(alert, route)

    @staticmethod
    def _alert_budget(alert: Alert) -> int | None:
        """The alert's `gpulens_budget_mb` annotation, or None (the coordinator's --budget-mb). A value
        that is not an integer in 1..65536 is logged and left out: the capture still runs, priced by
        the coordinator's default, rather than be lost to a typo in a rule file."""
        raw = alert.annotations.get(BUDGET_ANNOTATION)
        if raw is None:
            return None
        try:
            value = int(raw.strip())
        except ValueError:
            value = 0
        if 1 <= value <= 65536:
            return value
        log.warning("alert.bad_budget", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"),
                    value=raw[:100], detail=f"{BUDGET_ANNOTATION} must be an integer MiB in 1..65536: ignored")
        return None

    def _alert_request(self, alert: Alert, capture_id: str) -> dict[str, Any]:
        reason = CaptureReason(kind="alert", alertname=alert.labels.get("alertname"), fingerprint=alert.fingerprint,
                               starts_at=alert.starts_at, diagnosis=alert.labels.get("diagnosis"),
                               workload="/".join(v for v in (alert.labels.get("namespace"), alert.labels.get("pod"))
                                                 if v) or None,
                               text=(alert.annotations.get("summary") or None) and alert.annotations["summary"][:2000])
        s = self.settings
        if alert.capture_kind == "hang":
            # a stalled job: every rank's Flight Recorder and stacks as they are now, no Kineto window
            return CaptureRequest(job_id="", duration_ms=s.duration_ms, reason=reason, requested_by="alertmanager",
                                  capture_id=capture_id, kind="hang").to_dict()
        if serving_kind(alert.labels.get(WORKLOAD_LABEL)):
            # Replicas have no optimizer steps: a wall-clock window of the pod the alert is about
            # plus healthy peers to compare it with (a workload-wide alert: that many replicas).
            pod = alert.labels.get("pod")
            return CaptureRequest(job_id="", duration_ms=s.serving_duration_ms, activities=s.activities,
                                  reason=reason, requested_by="alertmanager", capture_id=capture_id,
                                  pods=(pod,) if pod else (), peers=s.serving_peers if pod else None,
                                  replicas=None if pod else s.serving_peers + 1,
                                  budget_mb=self._alert_budget(alert)).to_dict()
        return CaptureRequest(job_id="", duration_ms=s.duration_ms, activities=s.activities, reason=reason,
                              requested_by="alertmanager", capture_id=capture_id, iterations=s.iterations or None,
                              iteration_roundup=s.iteration_roundup if s.iterations else None,
                              budget_mb=self._alert_budget(alert)).to_dict()

    async def _firing(self, alert: Alert, route: Route) -> Outcome:
        entry = self.ledger.alerts.get(alert.key)
        if entry is not None and entry.outcome != "forwarding":
            return Outcome(alert.fingerprint, alert.starts_at, "duplicate", entry.capture_id,
                           f"already handled: {entry.outcome}")
        if entry is None:
            cooling = cooldown_key(route.namespace, route.job_id, alert.capture_kind)
            last = self.ledger.last_start.get(cooling)
            if last is not None and time.time() - last < self.settings.cooldown_s:
                since = self._last_capture_of(route.key, alert.capture_kind)
                entry = AlertEntry(alert.key, alert.fingerprint, alert.starts_at, route.namespace, route.job_id,
                                   "cooldown", capture_id=None,
                                   detail=f"{cooling} got capture {since or '?'} {time.time() - last:.0f} s ago "
                                          f"(cooldown {self.settings.cooldown_s:.0f} s, manual captures count too)")
                self.ledger.alerts[alert.key] = entry
                self.ledger.save()
                log.info("alert.cooldown", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"),
                         job=route.key, since_capture=since, detail=entry.detail)
                return Outcome(alert.fingerprint, alert.starts_at, "cooldown", detail=entry.detail)
            entry = AlertEntry(alert.key, alert.fingerprint, alert.starts_at, route.namespace, route.job_id,
                               "forwarding", capture_id=new_capture_id())
            self.ledger.alerts[alert.key] = entry
            self.ledger.save()  # before forwarding: a crash in between must reuse this capture id
        body = self._alert_request(alert, entry.capture_id)
        body["job_id"] = route.job_id
        try:
            await self.api_for(route.url).start(body, namespace=route.namespace)
        except ApiUnavailable as exc:
            if _is_dns_failure(exc):
                self.ledger.alerts.pop(alert.key, None)
                self.ledger.save()
                log.warning("alert.no_coordinator", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"), job=route.key, error=str(exc))
                return Outcome(alert.fingerprint, alert.starts_at, "unroutable", detail=f"no coordinator: {exc}")
            log.warning("alert.forward_failed", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"), job=route.key,
                        capture_id=entry.capture_id, error=str(exc))
            return Outcome(alert.fingerprint, alert.starts_at, "coordinator_unavailable", entry.capture_id, str(exc),
                           retryable=True)
        except ApiError as exc:
            body_ = exc.body if isinstance(exc.body, dict) else {}
            if exc.status in (401, 403):
                self.ledger.alerts.pop(alert.key, None)  # a fixed token must be able to try again
                self.ledger.save()
                log.error("alert.coordinator_auth_failed", job=route.key, status=exc.status)
                return Outcome(alert.fingerprint, alert.starts_at, "coordinator_auth_failed", detail=str(exc))
            entry.outcome = "busy" if body_.get("error") == "capture_in_progress" else "rejected"
            entry.detail = f"{body_.get('capture_id') or ''} {exc}".strip()
            self.ledger.save()
            log.warning("alert.not_started", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"), job=route.key, outcome=entry.outcome,
                        detail=entry.detail)
            return Outcome(alert.fingerprint, alert.starts_at, entry.outcome, body_.get("capture_id"), entry.detail)
        entry.outcome = "started"
        self.ledger.started(CaptureEntry(entry.capture_id, route.namespace, route.job_id, route.url, time.time(),
                                         {"kind": "alert", "alertname": alert.labels.get("alertname"),
                                          "fingerprint": alert.fingerprint, "starts_at": alert.starts_at},
                                         kind=alert.capture_kind))
        self.ledger.save()
        log.info("alert.capture_started", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"), job=route.key, capture_id=entry.capture_id)
        return Outcome(alert.fingerprint, alert.starts_at, "started", entry.capture_id)

    def _last_capture_of(self, job_key: str, kind: str = "trace") -> str | None:
        """The id of the newest capture of `kind` the gateway started for `job_key` (what a cooldown waits on)."""
        entries = [c for c in self.ledger.captures.values() if f"{c.namespace}/{c.job_id}" == job_key and c.kind == kind]
        return max(entries, key=lambda c: c.started_at).capture_id if entries else None

    async def _resolved(self, alert: Alert, route: Route) -> Outcome:
        entry = self.ledger.alerts.get(alert.key)
        if entry is None or entry.outcome != "started" or not entry.capture_id:
            return Outcome(alert.fingerprint, alert.starts_at, "ignored", detail="no capture for this alert episode")
        if entry.resolved_at == alert.ends_at:
            return Outcome(alert.fingerprint, alert.starts_at, "duplicate", entry.capture_id, "resolution already sent")
        captured = self.ledger.captures.get(entry.capture_id)
        url = captured.coordinator_url if captured else route.url
        try:
            await self.api_for(url).alert_resolved(entry.capture_id, alert.ends_at)
            outcome = "resolved"
        except ApiUnavailable as exc:
            return Outcome(alert.fingerprint, alert.starts_at, "coordinator_unavailable", entry.capture_id, str(exc),
                           retryable=True)
        except ApiError as exc:
            outcome = "unknown_capture" if exc.status == 404 else "rejected"
        entry.resolved_at = alert.ends_at
        self.ledger.save()
        log.info("alert.resolved", fingerprint=alert.fingerprint, alertname=alert.labels.get("alertname"), capture_id=entry.capture_id, outcome=outcome)
        return Outcome(alert.fingerprint, alert.starts_at, outcome, entry.capture_id)

    # --- people and scripts ------------------------------------------------------------------

    async def manual(self, body: Any, namespace: str | None, pod: str | None = None,
                     workload: str | None = None) -> tuple[int, dict[str, Any]]:
        """A person's capture. Serving workloads: the body names `pods` (with `peers`) or asks for
        `replicas`; without a job_id, `workload=Deployment/<name>` and a named pod find the revision."""
        if not isinstance(body, dict):
            return 400, {"error": "the body must be a capture request object", "field": ""}
        known = sorted(self.router.routes())  # lets a client list the jobs it could have meant
        if not namespace:
            return 400, {"error": "the gateway routes by namespace and none was given (query parameter namespace)",
                         "field": "namespace", "known_jobs": known}
        body = dict(body)
        if workload is not None and not serving_kind(workload):
            return 400, {"error": f"workload must be Deployment/NAME, StatefulSet/NAME or LeaderWorkerSet/NAME, "
                                  f"not {workload[:100]!r}", "field": "workload"}
        job = body.get("job_id")
        if not job and workload:
            named = body.get("pods") if isinstance(body.get("pods"), list) else []
            first = pod or next((p for p in named if isinstance(p, str)), None)
            job = deployment_revision(workload, first)
            if not job and not pod:
                return 400, {"error": f"no revision of {workload} can be told from {first!r}: give job_id "
                                      "(the revision's, e.g. <deployment>-<pod-template-hash>) or a pod of it",
                             "field": "job_id", "known_jobs": known}
        try:
            route = self.router.resolve(namespace, job, pod)
        except Unroutable as exc:
            return 404, {"error": str(exc), "field": "pod" if pod and not body.get("job_id") else "job_id",
                         "known_jobs": known}
        body["job_id"] = route.job_id
        body.setdefault("requested_by", "manual")
        body.setdefault("duration_ms", self.settings.duration_ms)
        body.setdefault("capture_id", new_capture_id())
        try:
            CaptureRequest.from_dict(body)
        except SchemaError as exc:
            return 400, {"error": str(exc), "field": exc.field}
        try:
            status, answer = await self.api_for(route.url).start(body, namespace=route.namespace)
        except ApiUnavailable as exc:
            return 503, {"error": "the job's coordinator is unavailable", "detail": str(exc), "job": route.key}
        except ApiError as exc:
            return exc.status, exc.body if isinstance(exc.body, dict) else {"error": str(exc)}
        capture_id = answer.get("capture_id", body["capture_id"]) if isinstance(answer, dict) else body["capture_id"]
        created = answer.get("created", True) if isinstance(answer, dict) else True
        if not created and capture_id in self.ledger.captures:  # a retry: same capture, cooldown unchanged
            log.info("manual.capture_repeated", job=route.key, capture_id=capture_id)
            return status, {"capture_id": capture_id, "status_url": f"/v1/captures/{capture_id}", "job": route.key,
                            "coordinator": route.url, "created": False}
        async with self._lock(route.key):
            self.ledger.started(CaptureEntry(capture_id, route.namespace, route.job_id, route.url, time.time(),
                                             {"kind": "manual", "requested_by": body["requested_by"]},
                                             kind=body.get("kind", "trace")))
            self.ledger.save()
        log.info("manual.capture_started", job=route.key, capture_id=capture_id, requested_by=body["requested_by"])
        return status, {"capture_id": capture_id, "status_url": f"/v1/captures/{capture_id}", "job": route.key,
                        "coordinator": route.url, "created": created}

    async def coordinator_of(self, capture_id: str) -> str | None:
        """The coordinator that holds a capture: the ledger, else ask every explicitly routed one."""
        entry = self.ledger.captures.get(capture_id)
        if entry:
            return entry.coordinator_url

        async def has(url: str) -> str | None:
            try:
                await self.api_for(url).status(capture_id)
                return url
            except ApiError:
                return None
        found = await asyncio.gather(*(has(u) for u in set(self.router.routes().values())))
        return next((u for u in found if u), None)
