"""The agent's state holder: accepts dispatches, runs one pipeline task per target, resumes after
a restart, and answers the API's questions from the persisted facts.

Dispatch is idempotent on (capture_id, target_id): the first PUT creates the target and starts its
task, every repeat returns the current status and changes nothing, so the coordinator may send at
least once. Cancel is logical: targets whose config is not queued yet end `failed(cancelled)`;
queued ones still land (stock dynolog cannot retract a config), and are archived as usual.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from gpulens.ground.logs import get_logger

from ..archive import under_prefix
from ..dynolog import KinetoConfigError, Delivery, KinetoOutcome, TraceConfig, build_config, log_file_for
from ..models import Dispatch, StepReading, TargetState, TargetStatus
from .pipeline import Pipeline
from .registry import Worker, WorkerRegistry
from .steps import StepsUnreadable
from .store import CAPTURE_ID_RE, TARGET_ID_RE, StatusStore, StoreWriteFailed, TargetRecord

__all__ = ["Agent", "DispatchRefused"]

_log = get_logger("agent")


class DispatchRefused(ValueError):
    """A dispatch the agent will not accept; `.field` names the offending part of the request."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class Housekeeping:
    stale_every_s: float = 30.0
    retention_s: float = 7 * 24 * 3600


class Agent:
    def __init__(self, *, pipeline: Pipeline, store: StatusStore, registry: WorkerRegistry, archive_root: str,
                 housekeeping: Housekeeping | None = None):
        self.pipeline, self.store, self.registry = pipeline, store, registry
        self.archive_root = archive_root
        self.housekeeping = housekeeping or Housekeeping()
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._house: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        resumed = 0
        for rec in self.store.load():
            if rec.status.terminal and rec.lingering_since is None:
                continue                       # over; one still watched for a late trace is resumed
            if (rec.status.state is TargetState.QUEUED_BY_DYNOLOG and rec.backend == "builtin"
                    and rec.delivered_at is None):
                # The builtin slot lived in the previous process. Queue again (at-least-once: a
                # duplicate is acceptable, a missed trace is not) under the same trace id: the
                # endpoint answers Kineto before this write, so Kineto may be tracing the earlier
                # copy, whose file then verifies; the pipeline retracts the copy left in the slot.
                rec.set_state(TargetState.DISPATCHED, "agent restarted before Kineto fetched the config; queueing again")
                self._try_put(rec, "target.requeue_not_persisted")  # the pipeline's next write carries it
            self._spawn(rec)
            resumed += 1
        _log.info("agent.resumed", targets=resumed)
        self._house = asyncio.create_task(self._housekeeping(), name="agent-housekeeping")

    async def stop(self) -> None:
        tasks = list(self._tasks.values()) + ([self._house] if self._house else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def _spawn(self, rec: TargetRecord) -> None:
        task = asyncio.create_task(self.pipeline.run(rec), name=f"target-{rec.capture_id}-{rec.target_id}")
        self._tasks[rec.key] = task
        task.add_done_callback(lambda t, key=rec.key: self._tasks.pop(key, None) if self._tasks.get(key) is t else None)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.housekeeping.stale_every_s)
            try:
                await asyncio.to_thread(self.registry.remove_stale)
                self._forget_old_captures()
            except Exception:  # noqa: BLE001 - housekeeping must never take the agent down
                _log.error("housekeeping.failed", exc_info=True)

    def _forget_old_captures(self) -> None:
        cutoff = time.time() - self.housekeeping.retention_s
        by_capture: dict[str, list[TargetRecord]] = {}
        for rec in self.store.all():
            by_capture.setdefault(rec.capture_id, []).append(rec)
        for capture_id, recs in by_capture.items():
            published = [self.store.status(capture_id, r.target_id) for r in recs]
            if all(p is not None and p.terminal and p.updated_at < cutoff for p in published):
                self.store.forget(capture_id)
                _log.info("store.capture_forgotten", capture_id=capture_id)

    # --- API operations -----------------------------------------------------------------------

    def dispatch(self, capture_id: str, target_id: str, body: Any) -> tuple[TargetStatus, bool]:
        """Accept (True) or repeat (False) a dispatch; DispatchRefused or schemas.SchemaError for bad input."""
        if not CAPTURE_ID_RE.fullmatch(capture_id):
            raise DispatchRefused("capture_id", f"capture id {capture_id!r} does not match {CAPTURE_ID_RE.pattern}")
        if not TARGET_ID_RE.fullmatch(target_id):
            raise DispatchRefused("target_id", f"target id {target_id!r} does not match {TARGET_ID_RE.pattern}")
        spec = Dispatch.from_dict(body)  # raises schemas.SchemaError naming the field
        existing = self.store.status(capture_id, target_id)
        if existing is not None:
            return existing, False
        if not under_prefix(self.archive_root, spec.archive_prefix):
            raise DispatchRefused("archive_prefix", f"{spec.archive_prefix} is outside this agent's archive root "
                                                    f"{self.archive_root}")
        if spec.deadline <= time.time():
            raise DispatchRefused("deadline", "the deadline has already passed")
        try:  # refuse now what Kineto would silently drop later
            build_config(TraceConfig(log_file_for("/x", capture_id, target_id), spec.duration_ms, spec.activities,
                                     spec.options))
        except KinetoConfigError as exc:
            raise DispatchRefused(exc.field, str(exc)) from exc
        rec = TargetRecord(capture_id, target_id, dict(body), TargetStatus(target_id))
        self.store.put(rec)  # StoreWriteFailed: not accepted (the API answers 503), nothing kept
        _log.info("target.accepted", capture_id=capture_id, target_id=target_id, rank=spec.rank, job_id=spec.job_id)
        self._spawn(rec)
        return self.store.status(capture_id, target_id), True

    def capture(self, capture_id: str) -> list[TargetStatus] | None:
        """The statuses on disk (never one still only in memory)."""
        return self.store.statuses(capture_id) or None

    def cancel(self, capture_id: str) -> bool:
        """Mark every unfinished target cancelled; each one's task ends it `failed(cancelled)` at its
        next step if its config was not queued yet (never in the middle of a trigger call, so a
        config that did get queued is never reported as cancelled)."""
        recs = self.store.capture(capture_id)
        for rec in recs:
            if rec.status.terminal or rec.cancelled:
                continue
            rec.cancelled = True  # acted on from memory at once; the pipeline's next write persists it
            self._try_put(rec, "target.cancel_not_persisted")
            _log.info("target.cancel_requested", capture_id=capture_id, target_id=rec.target_id,
                      state=rec.status.state.value)
        return bool(recs)

    def workers(self) -> list[Worker]:
        return self.registry.workers()

    def worker_views(self) -> list[dict[str, Any]]:
        """GET /v1/workers: each record, its resolved host pid and liveness, and its step count
        (what the coordinator chooses a capture's start iteration from)."""
        out = []
        for w in self.registry.workers():
            d = w.to_dict()
            d["steps"] = None
            if w.alive:
                try:
                    log = self.registry.steps(w.record.steps_file)
                except StepsUnreadable:
                    pass
                else:
                    if log.latest_at > 0:
                        d["steps"] = StepReading(log.latest, log.latest_at, log.rate()).to_dict()
            out.append(d)
        return out

    def on_delivered(self, delivery: Delivery) -> None:
        """Builtin endpoint callback: Kineto fetched a config; remember it (it matters after a restart)."""
        for rec in self.store.all():
            if (rec.backend == "builtin" and rec.trace_id == delivery.trace_id and rec.trace_id is not None
                    and rec.status.state is TargetState.QUEUED_BY_DYNOLOG):
                rec.delivered_at = delivery.at
                rec.status.detail = (rec.status.detail or "") + f"; Kineto fetched the config at {delivery.at:.3f}"
                rec.status.updated_at = time.time()
                self._try_put(rec, "target.delivery_not_persisted")
                return

    def on_kineto(self, outcome: KinetoOutcome) -> None:
        """Builtin endpoint callback: what Kineto's polls say it did with a fetched config. A refusal
        is only recorded here; the target's pipeline ends it `failed(kineto_refused)` (after a last
        look for the file), so the final status is written by one hand."""
        if outcome.trace_id is None:
            return
        for rec in self.store.all():
            if (rec.backend == "builtin" and rec.trace_id == outcome.trace_id
                    and rec.status.state is TargetState.QUEUED_BY_DYNOLOG):
                if outcome.kind == "started":
                    rec.kineto_started_at = outcome.at
                elif outcome.kind == "finished":
                    rec.kineto_idle_at = outcome.at
                elif outcome.cause == "another_pending":
                    # not proof on its own: the held config may have started and ended between two
                    # polls, unseen; the pipeline decides at the deadline (still held: refused)
                    held = self._named(outcome.held_trace_id)
                    rec.kineto_behind = outcome.describe() + (f" [held by {held}]" if held else "")
                    rec.kineto_behind_id = outcome.held_trace_id
                else:
                    rec.kineto_refusal = outcome.describe()
                rec.status.updated_at = time.time()
                self._try_put(rec, "target.kineto_not_persisted")
                return

    def _named(self, trace_id: str | None) -> str | None:
        """`capture <id> target <id>` of the target whose config carries `trace_id`, if it is ours."""
        for rec in self.store.all() if trace_id else ():
            if rec.trace_id == trace_id:
                return f"capture {rec.capture_id} target {rec.target_id}"
        return None

    def _try_put(self, rec: TargetRecord, event: str) -> None:
        """A write whose content the pipeline's next (retried) write also carries."""
        try:
            self.store.put(rec)
        except StoreWriteFailed as exc:
            _log.error(event, capture_id=rec.capture_id, target_id=rec.target_id, error=str(exc)[:300])
