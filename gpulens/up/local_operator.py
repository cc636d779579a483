"""The embedded stand-in for `gpulens operator`: one coordinator per (namespace, job, attempt) that
registers on this machine, and the gateway's routes kept in step with them.

Discovery is the registration records, as on a node; a job that appears later gets its own
coordinator, exactly as an armed job gets one from the operator in a cluster. The coordinators
that run are also Prometheus's scrape targets (a file_sd file), as the chart's coordinator
PodMonitor finds them in a cluster: one that stops, or exits for good, leaves that file.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING

from gpulens.capture.wire.labels import SERVING_KINDS
from gpulens.ground.logs import get_logger

from .scrape_targets import CoordinatorTarget, write_file_sd

if TYPE_CHECKING:
    from .host import UpHost
    from .supervisor import Child

__all__ = ["LocalOperator", "read_jobs", "serving_jobs"]

log = get_logger("up")


def read_jobs(registry) -> dict[tuple[str, str, int], set[str]]:
    """{(namespace, job, attempt): {pods}} from the registration records in `registry`."""
    jobs: dict[tuple[str, str, int], set[str]] = {}
    for path in sorted(registry.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            key = (str(rec["namespace"]), str(rec["job_id"]), int(rec["attempt"]))
            jobs.setdefault(key, set()).add(str(rec["pod"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or foreign file: the agent reports those
    return jobs


def serving_jobs(registry) -> set[tuple[str, str, int]]:
    """The (namespace, job, attempt) whose records name a serving workload (`"workload":
    "Deployment/web"`): a revision of replicas, whose coordinator runs with --serving as the
    operator's does in a cluster."""
    found: set[tuple[str, str, int]] = set()
    for path in sorted(registry.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            kind = str(rec.get("workload") or "").partition("/")[0]
            if kind in SERVING_KINDS:
                found.add((str(rec["namespace"]), str(rec["job_id"]), int(rec["attempt"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


class LocalOperator:
    def __init__(self, runner: "UpHost", interval_s: float = 1.0):
        self.runner = runner
        self.interval_s = interval_s
        self.coordinators: dict[tuple[str, str, int], str] = {}   # key -> URL
        self.pods: dict[str, str] = {}                               # "ns/pod" -> "ns/job"
        self._children: dict[tuple[str, str, int], tuple["Child", CoordinatorTarget]] = {}
        self._scraped: list[CoordinatorTarget] | None = None          # what the file_sd file says now

    async def run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception as exc:  # keep going: the next pass may succeed
                log.error("local_operator.error", error=str(exc))
            await asyncio.sleep(self.interval_s)

    async def reconcile(self) -> None:
        changed = False
        registry = self.runner.layout.registry
        jobs = read_jobs(registry)
        serving = serving_jobs(registry) if any(k not in self.coordinators for k in jobs) else set()
        for key, pods in jobs.items():
            namespace, job, attempt = key
            for pod in pods:
                if self.pods.get(f"{namespace}/{pod}") != f"{namespace}/{job}":
                    self.pods[f"{namespace}/{pod}"] = f"{namespace}/{job}"
                    changed = True
            if key in self.coordinators:
                continue
            # a newer attempt of the same job replaces the route (the old coordinator stays for its captures)
            spec = self.runner.coordinator_spec(namespace, job, attempt, index=len(self.coordinators),
                                                serving=key in serving)
            child = await self.runner.sup.start(spec)
            self.coordinators[key] = spec.url
            self._children[key] = (child, CoordinatorTarget(namespace, spec.name, spec.url))
            changed = True
            log.info("coordinator.started", namespace=namespace, job_id=job, attempt=attempt, url=spec.url)
            self.runner.say(f"gpulens up: {'serving revision' if key in serving else 'job'} {namespace}/{job} attempt "
                            f"{attempt} registered: coordinator at {spec.url} "
                            f"(pid {child.pid}, log {child.log_path})")
        if changed:
            self.write_routes()
        self.write_scrape_targets()

    async def stop_coordinator(self, key: tuple[str, str, int]) -> None:
        """Stop one coordinator; Prometheus stops scraping it (its route stays, as in reconcile)."""
        entry = self._children.get(key)
        if entry is not None:
            await self.runner.sup.stop_child(entry[1].pod)
            log.info("coordinator.stopped", namespace=key[0], job_id=key[1], attempt=key[2])
        self.write_scrape_targets()

    def write_scrape_targets(self) -> None:
        """The running coordinators as Prometheus's file_sd targets; rewritten only when they change."""
        running = [target for child, target in self._children.values() if not child.final]
        if running == self._scraped:
            return
        write_file_sd(self.runner.layout.coordinator_targets_file, running)
        self._scraped = running
        log.info("coordinator.scrape_targets", count=len(running), file=str(self.runner.layout.coordinator_targets_file))

    def write_routes(self) -> None:
        latest: dict[str, tuple[int, str]] = {}
        for (namespace, job, attempt), url in self.coordinators.items():
            name = f"{namespace}/{job}"
            if name not in latest or attempt > latest[name][0]:
                latest[name] = (attempt, url)
        doc = {"routes": {name: url for name, (_, url) in latest.items()}, "pods": dict(self.pods)}
        path = self.runner.layout.routes_file
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
        os.replace(tmp, path)
