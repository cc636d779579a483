"""The coordinator's core: accept captures, run each one prepare -> dispatch -> converge ->
manifest -> analysis, and keep the annotation in step. No HTTP here (server.py adapts it).

State is in memory only: a restarted coordinator runs none of the captures it did not start
(DESIGN.md, "Why one coordinator per job"); finished ones are still answered from the archive's
manifest, marked `from_archive` (archived.py). `--state-dir` keeps a copy of each finished
capture's status, which is what lists them after a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from gpulens.capture.annotations import AnnotationSink, AnnotationSync, capture_annotation
from gpulens.capture.archive import SUMMARY_KEY, ArchiveError, ArchiveStore, join_uri, open_archive
from gpulens.capture.dynolog import tick_aligned_start_ms
from gpulens.capture.wire import limits
from gpulens.capture.models import CaptureReason, CaptureRequest, FailureReason, StepReading, TargetState, new_capture_id
from gpulens.ground.logs import get_logger

from .agents import AgentFleet, AgentFailure
from .analysis_runner import AnalysisRunner
from .archived import list_kept, read_archived
from .budget import DEFAULT_BUDGET_MB, BudgetRefused, combined, measured_from, plan_budget
from .deadlines import DeadlinePolicy, DelayTracker
from .discovery import Discovery, DiscoveryError
from .fanout import AgentWorker, FanoutSettings
from .manifests import build_manifest, capture_prefix, check_artifacts, write_manifest
from .metrics import CoordinatorMetrics
from .progress import CaptureRecord, Phase
from .selection import SelectionError, select_replicas
from .start_iteration import StartPlan, plan_start

__all__ = ["CoordinatorSettings", "Coordinator", "CaptureBusy", "RequestMismatch"]

log = get_logger("coordinator")

#: how many attempts before its own a coordinator looks through for a capture id it does not hold
#: (one archive read each, only for ids it does not know)
EARLIER_ATTEMPTS = 8


class CaptureBusy(Exception):
    """Another capture of this job is still running (the trainers' config slots are taken)."""

    def __init__(self, active: CaptureRecord):
        super().__init__(f"capture {active.capture_id} is still {active.phase}")
        self.active = active


class RequestMismatch(Exception):
    """The request is for another job or attempt than this coordinator's."""

    def __init__(self, field_name: str, message: str, conflict: bool = False):
        super().__init__(message)
        self.field, self.conflict = field_name, conflict


@dataclass(frozen=True)
class CoordinatorSettings:
    job_id: str
    attempt: int
    namespace: str
    archive_root: str
    s3_endpoint: str | None = None
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    fanout: FanoutSettings = field(default_factory=FanoutSettings)
    report_base_url: str | None = None
    state_dir: Path | None = None
    max_captures: int = 200
    baseline_after_s: float = 0.0        # > 0: one healthy baseline capture once the job ran this long
    baseline_duration_ms: int = 3000
    budget_mb: int = DEFAULT_BUDGET_MB     # issue 27: per rank, for requests that name none (budget.py)
    serving: bool = False                  # issue 30: a serving revision (replicas; selection.py)
    hang_window_ms: int = 1000             # issue 45: the Kineto window that follows a hang capture (0: none)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, discovery: Discovery, agents: AgentFleet, *,
                 annotations: AnnotationSink | None = None, analysis: AnalysisRunner | None = None,
                 open_store: Callable[[str], ArchiveStore] | None = None,
                 annotation_backoff_s: tuple[float, float] = (1.0, 60.0), metrics: CoordinatorMetrics | None = None):
        self.settings, self.discovery, self.agents = settings, discovery, agents
        self.metrics = metrics or CoordinatorMetrics()  # this coordinator's own registry
        self.annotations, self.analysis = annotations, analysis
        self.open_store = open_store or (lambda prefix: open_archive(prefix, endpoint_url=settings.s3_endpoint)
                                         if prefix.startswith("s3://") else open_archive(prefix))
        self.annotation_backoff_s = annotation_backoff_s
        self.delays = DelayTracker()
        # ms into a second where this job's last wall-clock window ended: the phase its ranks' Kineto
        # profiler ticks are on now (capture/dynolog/config.py, tick_aligned_start_ms)
        self._tick_phase_ms = 0
        self.captures: OrderedDict[str, CaptureRecord] = OrderedDict()
        self._cancel: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._syncs: dict[str, AnnotationSync] = {}
        self.log = log.bind(job_id=settings.job_id, attempt=settings.attempt)

    # --- API used by the server ---------------------------------------------------------------

    def get(self, capture_id: str) -> CaptureRecord | None:
        return self.captures.get(capture_id)

    async def archived(self, capture_id: str) -> dict[str, Any] | None:
        """A capture this process does not hold: its status from the archive. Either this
        coordinator restarted since, or an earlier attempt's coordinator ran it (it drained and
        went; the job's Service is this one's now): its manifest lies under that attempt's prefix,
        so the attempts before this one are read too, newest first, at most EARLIER_ATTEMPTS back."""
        s = self.settings
        for attempt in range(s.attempt, max(-1, s.attempt - EARLIER_ATTEMPTS - 1), -1):
            found = await read_archived(capture_id, archive_root=s.archive_root, namespace=s.namespace,
                                        job_id=s.job_id, attempt=attempt, open_store=self.open_store)
            if found is not None:
                if attempt != s.attempt:
                    found["note"] = (f"read from the archive: attempt {attempt}'s coordinator ran it; this is "
                                     f"attempt {s.attempt}'s")
                return found
        return None

    def archived_list(self) -> list[dict[str, Any]]:
        return list_kept(self.settings.state_dir, set(self.captures))

    def active(self) -> CaptureRecord | None:
        return next((r for r in self.captures.values() if r.phase not in Phase.DONE), None)

    def start(self, request: CaptureRequest, namespace: str | None = None) -> tuple[CaptureRecord, bool]:
        """Accept a capture; returns (record, created). A repeated capture id returns the first one."""
        s = self.settings
        if request.job_id != s.job_id:
            raise RequestMismatch("job_id", f"this coordinator serves job {s.job_id!r}, not {request.job_id!r}")
        if namespace is not None and namespace != s.namespace:
            raise RequestMismatch("namespace", f"this coordinator serves namespace {s.namespace!r}, not {namespace!r}")
        if request.attempt is not None and request.attempt != s.attempt:
            raise RequestMismatch("attempt", f"this coordinator serves attempt {s.attempt}, not {request.attempt}",
                                  conflict=True)
        if request.selects_pods and not s.serving:
            raise RequestMismatch("pods", "pods, peers and replicas select replicas of a serving workload; "
                                          f"job {s.job_id!r} is a training job, whose captures take every rank")
        if s.serving and request.iterations:
            raise RequestMismatch("iterations", "a serving workload has no optimizer steps: ask for a wall-clock "
                                                "window (duration_ms) instead of iterations")
        if request.pods and request.replicas is not None:
            raise RequestMismatch("replicas", "name pods (with peers) or ask for a number of replicas, not both")
        if request.capture_id and request.capture_id in self.captures:
            return self.captures[request.capture_id], False
        active = self.active()
        if active is not None:
            raise CaptureBusy(active)
        if request.is_hang and (request.iterations or s.serving):
            raise RequestMismatch("kind", "a hang capture reads each rank's Flight Recorder and stacks as they are "
                                          "now: it takes no iterations, and a serving workload has no collectives")
        plan = None
        if not request.is_hang:   # a hang capture writes no trace: its evidence is a few MB a rank at most
            try:
                plan = plan_budget(request, default_mb=s.budget_mb, measured=self._measured())
            except BudgetRefused as exc:
                raise RequestMismatch("budget_mb", str(exc)) from exc
            request = plan.request
        capture_id = request.capture_id or new_capture_id()
        request = replace(request, capture_id=capture_id, attempt=s.attempt)
        record = CaptureRecord(capture_id, request, s.namespace, s.job_id, s.attempt)
        record.budget = plan
        record.archive_prefix = capture_prefix(s.archive_root, s.namespace, s.job_id, s.attempt, capture_id)
        self.captures[capture_id] = record
        self._cancel[capture_id] = asyncio.Event()
        self._evict()
        self.log.info("capture.accepted", capture_id=capture_id, requested_by=request.requested_by,
                      reason=request.reason.kind, fingerprint=request.reason.fingerprint,
                      kind=request.kind, budget_mb=request.budget_mb,
                      estimate_bytes=plan.budget.estimate_bytes if plan else None,
                      changes="; ".join(plan.changes) if plan and plan.changes else None)
        if plan is not None and plan.changes:
            record.note("budget", **plan.to_dict())
        self._tasks[capture_id] = asyncio.create_task(self._run(record), name=f"capture-{capture_id}")
        return record, True

    def _measured(self):
        """Trace size per iteration and per second over every capture of this job that archived one
        (each kind its own: a wall capture says nothing of an iteration's size, nor the reverse)."""
        found = [m for record in self.captures.values() if record.phase in Phase.DONE and record.targets
                 if (m := measured_from(build_manifest(record), record.request)) is not None]
        return combined(found)

    def cancel(self, capture_id: str) -> CaptureRecord | None:
        record = self.captures.get(capture_id)
        if record is None:
            return None
        if record.phase not in Phase.DONE and not record.cancelled:
            record.cancelled = True
            record.note("cancel", detail="logical cancel: configs already queued by dynolog still run")
            self._cancel[capture_id].set()
            self.log.info("capture.cancel", capture_id=capture_id)
        return record

    def alert_resolved(self, capture_id: str, ends_at: str) -> CaptureRecord | None:
        record = self.captures.get(capture_id)
        if record is not None and record.alert_resolved_at != ends_at:
            record.alert_resolved_at = ends_at
            record.note("alert_resolved", ends_at=ends_at)
            self._annotate(record)
        return record

    def schedule_baseline(self) -> asyncio.Task | None:
        """The job's automatic baseline: once it has run `baseline_after_s` under this coordinator
        (steadily: every expected target still discoverable), one capture with `baseline: true`;
        while another capture runs it waits its turn. Off when baseline_after_s is 0."""
        if self.settings.baseline_after_s <= 0:
            return None
        task = asyncio.create_task(self._baseline_when_steady(), name="baseline")
        self._tasks["baseline"] = task
        return task

    async def _baseline_when_steady(self) -> None:
        s = self.settings
        await asyncio.sleep(s.baseline_after_s)
        while True:
            try:
                targets, why = (await self.discovery.snapshot()).targets, "no targets"
            except DiscoveryError as exc:  # not discoverable now is not steady: try later
                targets, why = (), str(exc)
            if targets and self.active() is None:
                request = CaptureRequest(job_id=s.job_id, duration_ms=s.baseline_duration_ms, baseline=True,
                                         requested_by="gpulens-baseline",
                                         reason=CaptureReason(kind="manual", text=f"automatic baseline after "
                                                                                  f"{s.baseline_after_s:g} s of steady run"))
                record, _ = self.start(request)
                self.log.info("baseline.started", capture_id=record.capture_id, targets=len(targets))
                return
            self.log.info("baseline.waiting", why=why if not targets else "another capture is running")
            await asyncio.sleep(min(10.0, s.baseline_after_s))

    async def wait(self, capture_id: str) -> None:
        """Until the capture's lifecycle (including analysis) is over; for tests and shutdown."""
        task = self._tasks.get(capture_id)
        if task:
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in self._syncs.values():
            await sync.close()

    # --- one capture --------------------------------------------------------------------------

    async def _run(self, record: CaptureRecord) -> None:
        clog = self.log.bind(capture_id=record.capture_id)
        try:
            self._annotate(record)
            try:
                snapshot = await self.discovery.snapshot()
            except DiscoveryError as exc:
                clog.error("capture.prepare_failed", error=str(exc))
                record.set_phase(Phase.FAILED, f"discovery: {exc}")
                return
            if self.settings.serving:
                try:
                    snapshot = select_replicas(snapshot, record.request)
                except SelectionError as exc:
                    clog.error("capture.prepare_failed", error=str(exc))
                    record.set_phase(Phase.FAILED, f"selection: {exc}")
                    return
            record.freeze(snapshot)
            for w in snapshot.warnings:
                clog.warning("discovery.warning", detail=w)
            clog.info("capture.prepared", targets=len(snapshot.targets), dispatchable=len(snapshot.dispatchable),
                      world_size=snapshot.world_size)
            window_ms = record.request.duration_ms
            if record.request.is_hang:
                starts_at = None    # no Kineto window: each agent asks its ranks' hooks and reads their stacks now
            elif record.request.iterations:
                plan = await self._plan_start(record)
                record.start_iteration = plan.iteration
                record.note("start_iteration", iteration=plan.iteration, detail=plan.detail)
                clog.info("capture.start_iteration", iteration=plan.iteration, detail=plan.detail)
                window_ms = max(window_ms, min(600_000, int(plan.window_s * 1000)))
                starts_at = None
            else:
                # on the phase of Kineto's profiler tick: where this job's last window ended, so every
                # capture after a process's first gets a whole tick of room (tick_aligned_start_ms)
                record.start_time_ms = tick_aligned_start_ms(time.time() + self.settings.fanout.wall_start_lead_s,
                                                             self._tick_phase_ms)
                self._tick_phase_ms = (record.start_time_ms + record.request.duration_ms) % 1000
                starts_at = record.start_time_ms / 1000
                record.note("start_time", start_time_ms=record.start_time_ms,
                            detail=f"every rank starts its window at this instant, "
                                   f"{self.settings.fanout.wall_start_lead_s:g} s or more after dispatch "
                                   f"(poll + warm-up + slack), on the phase of Kineto's 1 s tick where the "
                                   f"job's last window ended")
                clog.info("capture.start_time", start_time_ms=record.start_time_ms)
            if record.request.is_hang:
                d = self.settings.deadlines.compute_hang(time.time())
            else:
                d = self.settings.deadlines.compute(time.time(), window_ms, self.delays.estimate(), starts_at=starts_at)
            record.agent_deadline, record.deadline, record.quiet_until = d.agent, d.coordinator, d.quiet_until
            record.set_phase(Phase.CAPTURING)
            self._annotate(record)
            await self._fan_out(record)
            check_artifacts(record)
            record.converged_at = time.time()
            try:
                record.manifest_uri = await write_manifest(build_manifest(record), record.archive_prefix,
                                                           open_store=self.open_store)
            except (ArchiveError, ValueError) as exc:
                clog.error("manifest.write_failed", error=str(exc))
                record.set_phase(Phase.FAILED, f"the manifest could not be written: {exc}")
                return
            record.manifest_written_at = time.time()
            clog.info("capture.converged", manifest_uri=record.manifest_uri, fully_succeeded=record.fully_succeeded,
                      missing_ranks=",".join(map(str, record.missing_ranks())) or None)
            record.set_phase(Phase.CONVERGED)
            self._annotate(record)
            await self._analyse(record)
            if record.request.is_hang:
                self._follow_with_window(record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must end the capture visibly, not leave it "capturing" forever
            clog.error("capture.internal_error", exc_info=True, error=str(exc))
            record.set_phase(Phase.FAILED, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if record.phase in Phase.DONE:
                self.metrics.capture_ended(record)
                self._annotate(record)
                self._keep_copy(record)

    def _follow_with_window(self, record: CaptureRecord) -> None:
        """A hang capture is followed by a short Kineto window of every rank (a trace capture of its
        own, with its own manifest): a rank that still works shows what it does, and a blocked
        rank's empty trace is archived as its evidence (`trace_empty`). Its id is the hang's
        `followed_by`; a capture already running (a person's) is left alone and the reason noted."""
        s = self.settings
        if s.hang_window_ms <= 0 or not any(p.state == TargetState.ARCHIVED for p in record.targets.values()):
            return
        request = CaptureRequest(job_id=s.job_id, duration_ms=s.hang_window_ms, requested_by="gpulens-hang",
                                 reason=CaptureReason(kind="manual", text=f"the Kineto window of hang capture "
                                                                          f"{record.capture_id}"))
        try:
            follow, _ = self.start(request)
        except (CaptureBusy, RequestMismatch) as exc:
            record.note("followed_by", capture_id=None, detail=f"no Kineto window: {exc}")
            self.log.warning("hang.window_skipped", capture_id=record.capture_id, error=str(exc))
            return
        record.followed_by = follow.capture_id
        record.note("followed_by", capture_id=follow.capture_id, duration_ms=s.hang_window_ms)
        self.log.info("hang.window_started", capture_id=record.capture_id, window_capture_id=follow.capture_id)

    async def _plan_start(self, record: CaptureRecord) -> StartPlan:
        """Ask each node agent for its ranks' step counts (a failed agent just reads as silent)."""
        s = self.settings
        urls = sorted({p.target.agent_url for p in record.targets.values() if not p.terminal and p.target.agent_url})

        async def one(url: str) -> list[dict[str, Any]]:
            try:
                return await asyncio.wait_for(self.agents.workers(url), 5.0)
            except (AgentFailure, asyncio.TimeoutError) as exc:
                self.log.warning("start_iteration.agent_silent", capture_id=record.capture_id, agent=url, error=str(exc))
                return []
        views = [w for ws in await asyncio.gather(*(one(u) for u in urls)) for w in ws]
        readings: dict[int, StepReading | None] = {p.target.rank: None for p in record.targets.values() if not p.terminal}
        for w in views:
            if (w.get("job_id"), w.get("attempt"), w.get("alive")) != (s.job_id, s.attempt, True) \
                    or w.get("global_rank") not in readings or not w.get("steps"):
                continue
            try:
                readings[w["global_rank"]] = StepReading.from_dict(w["steps"])
            except ValueError as exc:
                self.log.warning("start_iteration.bad_reading", capture_id=record.capture_id, rank=w["global_rank"],
                                 error=str(exc))
        return plan_start(readings, record.request.iterations or 1, now=time.time(),
                          lead_s=self.settings.fanout.start_lead_s)

    async def _fan_out(self, record: CaptureRecord) -> None:
        cancel = self._cancel[record.capture_id]
        by_agent: dict[str, list] = {}
        for p in record.targets.values():
            if not p.terminal:
                by_agent.setdefault(p.target.agent_url, []).append(p)
        if cancel.is_set():
            for p in (p for ps in by_agent.values() for p in ps):
                record.update(p.target.target_id, TargetState.FAILED, FailureReason.CANCELLED, "cancelled during prepare")
            return
        workers = [AgentWorker(record, url, ps, self.agents, self.settings.fanout, self.delays)
                   for url, ps in by_agent.items()]
        await asyncio.gather(*(w.run(cancel) for w in workers))

    async def _analyse(self, record: CaptureRecord) -> None:
        if self.analysis is None:
            record.analysis = {"state": "disabled"}
        elif not any(p.state == TargetState.ARCHIVED for p in record.targets.values()):
            record.analysis = {"state": "skipped", "reason": "no rank was archived"}
        else:
            record.analysis = {"state": "running"}
            record.note("analysis", **record.analysis)
            self._annotate(record)
            record.analysis = await self.analysis.run(record.manifest_uri, record.capture_id)
            record.report_uri = record.analysis.get("report_uri")
            if record.analysis.get("state") == "done" and record.request.is_hang:
                verdict = await asyncio.to_thread(self._verdict_line, record)
                if verdict:
                    record.analysis["verdict"] = verdict
        record.note("analysis", **record.analysis)

    def _verdict_line(self, record: CaptureRecord) -> str | None:
        """The hang report's one line (rank, pod, node, collective, sequence id), read back from the
        summary `gpulens analyze` wrote beside the manifest: the annotation and status lead with it."""
        prefix = record.archive_prefix
        try:
            raw = self.open_store(prefix).get_bytes(join_uri(prefix, SUMMARY_KEY))
            summary = limits.loads(raw, limits.SUMMARY_FILE)
            line = summary["verdict"]["line"]
        except (ArchiveError, ValueError, KeyError, TypeError) as exc:
            self.log.warning("analysis.verdict_unreadable", capture_id=record.capture_id, error=str(exc)[:300])
            return None
        return line if isinstance(line, str) else None

    # --- side effects that never block a capture ---------------------------------------------

    def _annotate(self, record: CaptureRecord) -> None:
        if self.annotations is None:
            return
        sync = self._syncs.get(record.capture_id)
        if sync is None:
            def changed(state: dict[str, Any], record=record) -> None:
                record.annotation = state
                record.note("annotation", **state)
            sync = AnnotationSync(self.annotations, f"capture:{record.capture_id}", on_change=changed,
                                  backoff_initial_s=self.annotation_backoff_s[0],
                                  backoff_max_s=self.annotation_backoff_s[1],
                                  context={"capture_id": record.capture_id})
            self._syncs[record.capture_id] = sync
        sync.set(capture_annotation(record.to_status(full=False), archive_root=self.settings.archive_root,
                                    base_url=self.settings.report_base_url))

    def _keep_copy(self, record: CaptureRecord) -> None:
        if self.settings.state_dir is None:
            return
        try:
            folder = Path(self.settings.state_dir) / "captures"
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{record.capture_id}.json.tmp"
            tmp.write_text(json.dumps(record.to_status(full=True), indent=1, sort_keys=True, default=str))
            os.replace(tmp, folder / f"{record.capture_id}.json")
        except OSError as exc:
            self.log.warning("state.write_failed", capture_id=record.capture_id, error=str(exc))

    def _evict(self) -> None:
        while len(self.captures) > self.settings.max_captures:
            victim = next((cid for cid, r in self.captures.items() if r.phase in Phase.DONE
                           and r.analysis.get("state") != "running"), None)
            if victim is None:
                return
            self.captures.pop(victim)
            self._cancel.pop(victim, None)
            self._tasks.pop(victim, None)
            sync = self._syncs.pop(victim, None)
            if sync is not None and sync.synced:
                asyncio.ensure_future(sync.close())
            elif sync is not None:
                self._syncs[victim] = sync  # keep retrying the annotation; only the status is forgotten
