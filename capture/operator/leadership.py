"""Leader election with a coordination.k8s.io/v1 Lease, so only one operator replica reconciles.

Why a Lease and not kopf peering: kopf's peering pauses *every* operator of equal priority, and a
Lease is what every other controller (and `kubectl get lease`) understands. The decision is a pure
function of the Lease and the clock (`decide`); the I/O is one read and one create-or-replace with
the read resourceVersion, so two replicas racing for an expired Lease cannot both win (the API
server answers the loser 409). A leader that cannot renew for `renew_deadline` stops reconciling
before anyone else may take over (`lease_duration`), and the process exits so Kubernetes restarts it
as a follower. Replicas that are not leading still serve the webhook.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpulens.ground.logs import get_logger

from .stopping import stopped_within

__all__ = ["Decision", "decide", "LeaseElector"]

log = get_logger("operator")


def _fmt(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Decision:
    action: str                          # "create", "update" or "follow"
    leader: str                          # who leads if the action succeeds
    spec: Mapping[str, Any] | None = None


def decide(lease: Mapping[str, Any] | None, identity: str, now: float, duration_s: float) -> Decision:
    """What to do with the Lease as read: take it, renew it, or follow its holder."""
    new = {"holderIdentity": identity, "leaseDurationSeconds": max(1, int(round(duration_s))),
           "renewTime": _fmt(now)}
    if lease is None:
        return Decision("create", identity, {**new, "acquireTime": _fmt(now), "leaseTransitions": 0})
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder == identity:
        return Decision("update", identity, {**spec, **new})
    renewed = _parse(spec.get("renewTime")) or _parse(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or duration_s
    if not holder or renewed is None or renewed + float(duration) < now:
        return Decision("update", identity, {**spec, **new, "acquireTime": _fmt(now),
                                             "leaseTransitions": int(spec.get("leaseTransitions") or 0) + 1})
    return Decision("follow", holder)


class LeaseElector:
    def __init__(self, api_client: k8s.ApiClient, namespace: str, name: str, identity: str,
                 duration_s: float = 15.0, renew_period_s: float = 5.0, clock: Callable[[], float] = time.time):
        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration_s, self.renew_period_s, self.clock = duration_s, renew_period_s, clock
        self.last_renewed: float | None = None
        self.observed_leader: str | None = None     # None: unknown (the last read failed)

    def _read(self) -> dict[str, Any] | None:
        try:
            resp = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            return json.loads(resp.data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def try_acquire(self) -> bool:
        """One round: True when this replica holds the Lease afterwards. Never raises for API faults."""
        now = self.clock()
        self.observed_leader = None
        try:
            lease = self._read()
            decision = decide(lease, self.identity, now, self.duration_s)
            if decision.action == "follow":
                self.observed_leader = decision.leader
                return False
            meta = {"name": self.name, "namespace": self.namespace}
            if decision.action == "create":
                self.api.create_namespaced_lease(self.namespace, {"apiVersion": "coordination.k8s.io/v1",
                                                                  "kind": "Lease", "metadata": meta,
                                                                  "spec": dict(decision.spec or {})},
                                                 _preload_content=False)
            else:
                meta["resourceVersion"] = (lease or {}).get("metadata", {}).get("resourceVersion")
                self.api.replace_namespaced_lease(self.name, self.namespace,
                                                  {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                   "metadata": {k: v for k, v in meta.items() if v},
                                                   "spec": dict(decision.spec or {})},
                                                  _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:   # 409: another replica won this round
                log.warning("lease.error", lease=self.name, status=exc.status, reason=exc.reason)
            return False
        except Exception as exc:  # connection faults: try again next round
            log.warning("lease.error", lease=self.name, reason=type(exc).__name__)
            return False
        self.last_renewed = now
        self.observed_leader = self.identity
        return True

    def release(self) -> None:
        """Give the Lease up on a clean shutdown so a follower takes over at once."""
        try:
            lease = self._read()
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
                self.api.replace_namespaced_lease(self.name, self.namespace,
                                                  {**lease, "spec": spec}, _preload_content=False)
                log.info("lease.released", lease=self.name, identity=self.identity)
        except Exception as exc:
            log.warning("lease.release_failed", lease=self.name, reason=type(exc).__name__)

    @property
    def renew_deadline_s(self) -> float:
        return self.duration_s * 2 / 3

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica leads (True) or `stop` is set (False)."""
        announced = False
        while not stop.is_set():
            if await asyncio.to_thread(self.try_acquire):
                log.info("lease.acquired", lease=self.name, identity=self.identity)
                return True
            if not announced:
                log.info("lease.following", lease=self.name, identity=self.identity)
                announced = True
            await stopped_within(stop, self.renew_period_s)
        return False

    async def keep(self, stop: asyncio.Event, lost: asyncio.Event) -> None:
        """Renew until `stop`; set `lost` (and `stop`) when leadership cannot be confirmed in time."""
        while not stop.is_set():
            if await stopped_within(stop, self.renew_period_s):
                return
            ok = await asyncio.to_thread(self.try_acquire)
            taken = self.observed_leader not in (None, self.identity)
            expired = self.last_renewed is None or self.clock() - self.last_renewed > self.renew_deadline_s
            if not ok and (taken or expired):
                log.error("lease.lost", lease=self.name, identity=self.identity, leader=self.observed_leader)
                lost.set()
                stop.set()
                return
