"""Observe -> plan -> apply, for one job or for the whole cluster. Called by the kopf handlers and
by the periodic resync; safe to call any number of times (that is what makes restarts harmless).

Nothing here touches a running coordinator Pod: a Pod is created when missing and never replaced,
and only a CaptureCoordinator's deletion (job gone, newer attempt) ends one. A coordinator that
says it still runs a capture is not deleted yet (it drains): its capture converges, with the
targets of a lost node or a dead attempt failed for their reasons and its manifest written, and a
later reconcile (at the latest the resync) deletes it. The job's Service goes to the new one at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from gpulens.ground.logs import get_logger

from ..wire import labels as L
from .captures_probe import in_flight
from .config import OperatorConfig
from .jobs import JobRef
from .kube import KubeApi, KubeError
from .manifests import (coordinator_pod, coordinator_role_binding, coordinator_service, coordinator_service_account,
                        copied_secret, owner_reference_to)
from .planning import JobPlan, coordinator_status, coordinators_by_job, group_pods, plan_job, summarize_captures

__all__ = ["Reconciler"]

log = get_logger("operator")


@dataclass
class Reconciler:
    """Holds the API door and the config; no other state, so any replica can pick up after another."""
    api: KubeApi
    config: OperatorConfig
    #: endpoint -> the coordinator's `GET /v1/captures` answer (None: unavailable); resync only.
    captures: Callable[[str], Mapping[str, Any] | None] | None = None

    # --- owners ----------------------------------------------------------------------------
    def _resolve_owner(self, job: JobRef) -> tuple[JobRef, bool | None]:
        """Fill in the owner's uid; False when the owner is gone (or replaced by a namesake)."""
        if job.owner is None:
            return job, None
        found = self.api.get_owner(job.owner, job.namespace)
        if found is None:
            return job, False
        uid = (found.get("metadata") or {}).get("uid")
        if job.owner.uid and uid and uid != job.owner.uid:
            return job, False
        return (replace(job, owner=replace(job.owner, uid=uid)) if uid else job), True

    # --- one job ---------------------------------------------------------------------------
    def reconcile_job(self, namespace: str, job_id: str) -> JobPlan:
        pods = self.api.list_armed_pods(namespace)
        groups = group_pods(pods)
        job, job_pods = groups.get((namespace, job_id), (None, []))
        owner_exists = None
        if job is not None:
            job, owner_exists = self._resolve_owner(job)
        ccs = [cc for cc in self.api.list_coordinators(namespace) if (cc.get("spec") or {}).get("jobId") == job_id]
        plan = plan_job((namespace, job_id), job, job_pods, ccs, owner_exists, self.config)
        self.apply(plan)
        return plan

    def resync(self) -> list[JobPlan]:
        """Cluster-wide: the safety net for missed events, and the cleanup of orphans."""
        groups = group_pods(self.api.list_armed_pods())
        by_job = coordinators_by_job(self.api.list_coordinators())
        plans, failed = [], []
        for key in sorted(set(groups) | set(by_job)):
            job, job_pods = groups.get(key, (None, []))
            try:
                owner_exists = None
                if job is not None:
                    job, owner_exists = self._resolve_owner(job)
                plan = plan_job(key, job, job_pods, by_job.get(key, []), owner_exists, self.config)
                self.apply(plan)
                plans.append(plan)
            except KubeError as exc:
                failed += self._job_failed(key, exc)
        # Children of the coordinators that stay (a Pod deleted by hand, a node lost), and status.
        for cc in self.api.list_coordinators():
            if not cc["metadata"].get("deletionTimestamp"):
                try:
                    self.ensure_children(cc)
                    self.refresh_status(cc, with_captures=True)
                except KubeError as exc:
                    failed += self._job_failed((cc["metadata"]["namespace"], cc["spec"].get("jobId", "")), exc)
        if failed:
            raise failed[0]      # the others were reconciled; the caller logs the failure
        return plans

    @staticmethod
    def _job_failed(key: tuple[str, str], exc: KubeError) -> list[KubeError]:
        """One job's failure does not stop the resync of the others (hundreds of jobs, one of
        them in a namespace being deleted). A namespace being deleted is not a failure at all."""
        if exc.namespace_terminating:
            log.info("resync.skipped", namespace=key[0], job_id=key[1], reason="namespace terminating")
            return []
        log.warning("resync.job_failed", namespace=key[0], job_id=key[1], reason=str(exc))
        return [exc]

    # --- applying --------------------------------------------------------------------------
    def apply(self, plan: JobPlan) -> None:
        ns, job_id = plan.key
        if plan.create is not None:
            created = self.api.create(plan.create)
            name = plan.create["metadata"]["name"]
            cc = created or self.api.get_coordinator(ns, name)
            log.info("coordinator.created" if created else "coordinator.exists", namespace=ns, job_id=job_id,
                     coordinator=name, attempt=plan.create["spec"]["attempt"], reason=plan.reason)
            if cc is not None:
                self.ensure_children(cc)
        elif plan.keep and plan.delete:
            cc = self.api.get_coordinator(ns, plan.keep)
            if cc is not None:
                self.ensure_children(cc)   # hand the Service over before the old owner goes
        for name in plan.delete:
            running = self._running_captures(ns, name)
            if running:
                log.info("coordinator.draining", namespace=ns, job_id=job_id, coordinator=name, reason=plan.reason,
                         captures=",".join(running))
                continue
            if self.api.delete_coordinator(ns, name):
                log.info("coordinator.deleted", namespace=ns, job_id=job_id, coordinator=name, reason=plan.reason)

    def _running_captures(self, ns: str, name: str) -> list[str]:
        """What coordinator `name` says it is still capturing, asked at its Pod (the job's Service
        may point at its successor already); [] when it cannot be asked or does not answer: one
        that is gone with a lost node drains nothing."""
        if self.captures is None:
            return []
        pod = self.api.get_pod(ns, name)
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if not ip or ((pod or {}).get("metadata") or {}).get("deletionTimestamp"):
            return []
        listing = self.captures(f"http://{ip}:{self.config.coordinator.port}")
        return in_flight(listing) if listing is not None else []

    def ensure_children(self, cc: Mapping[str, Any]) -> list[str]:
        """Create whatever of the coordinator's objects is missing; returns what it created or fixed."""
        if not cc.get("metadata", {}).get("uid"):
            return []
        ns, name = cc["metadata"]["namespace"], cc["metadata"]["name"]
        # The Service first: it needs nothing else, and a Pod create the API server refuses for a
        # while (1.20: no token for the new ServiceAccount yet) must not hold it back.
        done: list[str] = self._ensure_service(cc)
        # The Pod is created last, so an existing Pod means its ServiceAccount, RoleBinding and
        # Secrets were created before it (they are never changed, and go with the CR). Checking
        # the Pod alone keeps a restarted operator from writing anything, and the operator from
        # needing to read Secrets outside its own namespace.
        if self.api.get_pod(ns, name) is None:
            done += self._create_pod_and_its_objects(cc)
        if done:
            log.info("coordinator.children", namespace=ns, coordinator=name, created=",".join(done))
        return done

    def _create_pod_and_its_objects(self, cc: Mapping[str, Any]) -> list[str]:
        name = cc["metadata"]["name"]
        tokens = self.api.get_secret_data(self.config.namespace, self.config.tokens_secret)
        if tokens is None:
            log.error("tokens.missing", namespace=self.config.namespace, secret=self.config.tokens_secret,
                      coordinator=name)
            return []
        bodies = [coordinator_service_account(cc, self.config), coordinator_role_binding(cc, self.config),
                  copied_secret(cc, "tokens", tokens)]
        archive_secret = (cc["spec"].get("archive") or {}).get("secretName")
        if archive_secret:
            data = self.api.get_secret_data(self.config.namespace, archive_secret)
            if data is None:
                log.error("archive_secret.missing", namespace=self.config.namespace, secret=archive_secret,
                          coordinator=name)
                return []
            bodies.append(copied_secret(cc, "archive", data))
        bodies.append(coordinator_pod(cc, self.config))
        return [f"{b['kind']}/{b['metadata']['name']}" for b in bodies if self.api.create(b) is not None]

    def _ensure_service(self, cc: Mapping[str, Any]) -> list[str]:
        want = coordinator_service(cc, self.config)
        ns, svc = want["metadata"]["namespace"], want["metadata"]["name"]
        have = self.api.get_service(ns, svc)
        if have is None:
            return [f"Service/{svc}"] if self.api.create(want) is not None else []
        have_sel = (have.get("spec") or {}).get("selector") or {}
        have_owner = [r.get("uid") for r in (have.get("metadata") or {}).get("ownerReferences") or []]
        if have_sel == want["spec"]["selector"] and have_owner == [cc["metadata"]["uid"]]:
            return []
        patched = self.api.patch_service(ns, svc, {
            "metadata": {"ownerReferences": [owner_reference_to(cc, controller=False)]},
            "spec": {"selector": want["spec"]["selector"]}})
        if patched is None:
            # Gone between the read and the patch: the garbage collector took it because its only
            # owner, the previous attempt's coordinator, was deleted while no pod was live (a
            # failed pod before its replacement). Create it, or the job has no Service until the
            # next resync.
            created = self.api.create(want) is not None
            log.info("service.recreated", namespace=ns, service=svc, coordinator=cc["metadata"]["name"],
                     created=created)
            return [f"Service/{svc}(recreated)"] if created else []
        log.info("service.handed_over", namespace=ns, service=svc, coordinator=cc["metadata"]["name"])
        return [f"Service/{svc}(handover)"]

    def refresh_status(self, cc: Mapping[str, Any], with_captures: bool = False) -> dict[str, Any] | None:
        ns, name = cc["metadata"]["namespace"], cc["metadata"]["name"]
        pod = self.api.get_pod(ns, name)
        status = coordinator_status(cc, pod, self.config)
        old = dict(cc.get("status") or {})
        if with_captures and self.captures is not None and status["phase"] == "Ready":
            listing = self.captures(status["endpoint"])
            if listing is not None:
                status["lastCaptures"] = summarize_captures(listing)
        if all(old.get(k) == v for k, v in status.items()):
            return None
        return self.api.patch_coordinator_status(ns, name, status)

    def status_for_pod(self, pod: Mapping[str, Any]) -> None:
        """A coordinator Pod changed: reflect it in its CaptureCoordinator's status."""
        labels = (pod.get("metadata") or {}).get("labels") or {}
        name, ns = labels.get(L.COORDINATOR_OF), pod["metadata"].get("namespace")
        if not name or not ns:
            return
        cc = self.api.get_coordinator(ns, name)
        if cc is not None and not cc["metadata"].get("deletionTimestamp"):
            self.refresh_status(cc)
