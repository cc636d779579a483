"""One target's way through the node: trigger -> observe -> verify -> archive, each step persisted.

The runner is a loop over the target's *persisted* state, so a restarted agent resumes every
unfinished target where it stood. The order on the node is fixed: nothing is verified before its
file exists, nothing archived before it verified, nothing reported archived before the store
confirmed, and no local byte is deleted before that report is on disk. Every way out is a
terminal state with a reason and a detail a person can act on.

A state the disk refused (full, read-only) is not shown and not acted on: the same state is
written again with backoff until it lands, and only then does the target move on. So a final
status is never reported before it is on disk, and a restart resumes from what was reported.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import posixpath
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from gpulens.ground.logs import get_logger

from ..archive import ArchiveError, ArchiveStore, RetryPolicy, put_file_retrying
from ..dynolog import (KinetoConfigError, OnDemandResult, PidOutcome, TraceConfig, TriggerFailed, build_config,
                       kineto_trace_path, log_file_for)
from ..models import Artifact, FailureReason, TargetState, TriggerAttempt
from .metrics import AgentMetrics
from .observation import ObservedFile, Observer
from .registry import Worker, WorkerRegistry, agent_view
from . import hang_capture, start_rules
from .flight import dump_path as flight_dump_path
from .hang_evidence import collect_hang_evidence
from .space import NodeDisk, NodeReservations, artifact_sizes
from .steps import StepLog, StepsUnreadable
from .store import FinalStatusConflict, StatusStore, StoreWriteFailed, TargetRecord
from .triggers import Trigger
from .verification import Expectation, Verdict, verify_trace

__all__ = ["PipelineSettings", "Pipeline", "archive_key"]

_log = get_logger("agent")
R = FailureReason
S = TargetState


@dataclass(frozen=True)
class PipelineSettings:
    node: str
    trace_dir: Path
    archive_root: str
    retry_interval_s: float = 1.0        # between trigger attempts (not matched, busy)
    registration_grace_s: float = 5.0    # a record may appear just after the dispatch
    unreachable_attempts: int = 3        # dynolog not answering this often in a row: fail
    trace_overhead_s: float = 12.0       # poll (5) + warm-up (5 + 2): no trigger later than deadline - this - duration
    clock_slack_s: float = 5.0           # tolerated skew when placing events in the window
    liveness_interval_s: float = 2.0
    keep_local: bool = False
    persist_retry_s: tuple[float, float] = (0.5, 30.0)  # first and longest pause between writes of a state
    linger_max_s: float = 600.0          # a failed target's queued config is watched this long at most for a late trace
    linger_write_s: float = 60.0         # a due (or finished) trace writes its file within this
    kineto_poll_s: float = 5.0           # Kineto polls for configs this often
    archive_policy: RetryPolicy = field(default_factory=RetryPolicy)
    disk: NodeDisk | None = None    # issue 27: free-space guard and gzip staging (None: defaults under the state dir)
    socket_dir: Path | None = None  # issue 45: the agent's --socket-dir, where the hooks' Flight Recorder sockets are
    flight_timeout_s: float = 10.0  # issue 45: how long a hook may take to answer (a GIL-holding rank never does)


def archive_key(archive_root: str, archive_prefix: str, target_id: str, suffix: str = ".json.gz", *,
                late: bool = False, tag: str | None = None) -> str:
    """The key under `archive_root` for `<archive_prefix>/traces/<target_id><suffix>` (`.late<suffix>`
    for a trace that landed after its target had ended, `.<tag><suffix>` for a failed target's trace
    kept as its evidence, e.g. `misaligned`: never what the manifest names as an artifact)."""
    root = posixpath.normpath("/" + urlparse(archive_root).path.strip("/"))
    prefix = posixpath.normpath("/" + urlparse(archive_prefix).path.strip("/"))
    rel = posixpath.relpath(prefix, root)
    tag = "late" if late else tag
    name = f"traces/{target_id}{'.' + tag if tag else ''}{suffix}"
    return name if rel == "." else f"{rel}/{name}"


class Pipeline:
    def __init__(self, settings: PipelineSettings, *, registry: WorkerRegistry, trigger: Trigger,
                 store: StatusStore, observer: Observer, verify_pool: Executor, archive: ArchiveStore,
                 metrics: AgentMetrics | None = None):
        self.s = settings
        self.registry, self.trigger, self.store = registry, trigger, store
        self.observer, self.verify_pool, self.archive = observer, verify_pool, archive
        self.metrics = metrics or AgentMetrics()
        self.disk = settings.disk or NodeDisk(store.root.parent / "staging")
        self.claims = NodeReservations()   # every in-flight target's disk claim: the guard is per node
        # targets whose config reached Kineto's side (queued) and whose trace has neither landed nor
        # been proven never to come: while one is here its capture's folder stays, and its process
        # gets no other config (Kineto would ignore it)
        self._unresolved: dict[tuple[str, str], TargetRecord] = {}

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, rec: TargetRecord) -> None:
        log = _log.bind(capture_id=rec.capture_id, target_id=rec.target_id)
        resumed_linger = rec.status.terminal and rec.lingering_since is not None
        if rec.queued_at is not None and rec.status.state is S.QUEUED_BY_DYNOLOG or resumed_linger:
            self._unresolved[rec.key] = rec    # resumed after a restart with its config out there
        while not resumed_linger:
            try:
                await self._steps(rec)
                break
            except asyncio.CancelledError:
                raise
            except StoreWriteFailed as exc:
                await self._persist(rec, log, exc)   # then carry on from the state that is now on disk
            except FinalStatusConflict as exc:
                log.error("target.final_status_conflict", error=str(exc))
                break
            except Exception as exc:  # noqa: BLE001 - a bug must end as a visible failure, not a stuck target
                log.error("target.internal_error", exc_info=True)
                published = self.store.status(rec.capture_id, rec.target_id)
                if published is not None and published.terminal:
                    break  # its final status is on disk already; never a second one
                rec.fail(R.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
                await self._persist(rec, log, None)
                break
        published = self.store.status(rec.capture_id, rec.target_id)
        if published is not None and published.terminal and not resumed_linger:
            self.metrics.target_ended(published)  # once per run: what is on disk, as the coordinator sees it
        if rec.key in self._unresolved:
            try:
                await self._linger(rec, log, resumed=resumed_linger)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a late look must never take the agent down
                log.error("target.linger_failed", exc_info=True)
            finally:
                self._unresolved.pop(rec.key, None)
        if not self.s.keep_local:
            self._drop_local(rec)
        self.claims.release(rec.key)   # over, its local files gone (or kept on purpose): its claim ends

    async def _steps(self, rec: TargetRecord) -> None:
        log = _log.bind(capture_id=rec.capture_id, target_id=rec.target_id)
        while not rec.status.terminal:
            state = rec.status.state
            if rec.cancelled and state in (S.PENDING, S.DISPATCHED, S.NOT_MATCHED, S.WAITING_FOR_SLOT):
                self._fail(rec, R.CANCELLED, "cancelled before the config was queued")
            elif rec.spec.kind == "hang":
                await self._hang(rec, log)   # one step: asked, read, checked, archived (again after a restart)
            elif state in (S.PENDING, S.DISPATCHED, S.NOT_MATCHED, S.WAITING_FOR_SLOT):
                await self._trigger(rec, log)
            elif state is S.QUEUED_BY_DYNOLOG:
                await self._observe(rec, log)
            elif state is S.TRACE_OBSERVED:
                await self._verify(rec, log)
            elif state is S.VERIFIED:
                await self._archive(rec, log)
            else:  # pragma: no cover - every state is handled above
                self._fail(rec, R.INTERNAL_ERROR, f"no step for state {state.value}")

    async def _persist(self, rec: TargetRecord, log, first: StoreWriteFailed | None) -> None:
        """Write `rec` until the disk takes it (backoff; logged on the first failure and every tenth)."""
        pause, longest = self.s.persist_retry_s
        failures = 0 if first is None else 1
        if first is not None:
            log.error("store.write_failed", state=rec.status.state.value, attempt=1, error=str(first)[:300])
        while True:
            if failures:
                await asyncio.sleep(pause)
                pause = min(longest, pause * 2)
            try:
                self.store.put(rec)
            except StoreWriteFailed as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    log.error("store.write_failed", state=rec.status.state.value, attempt=failures, error=str(exc)[:300])
                continue
            except FinalStatusConflict as exc:
                log.error("target.final_status_conflict", error=str(exc))
                return
            if failures:
                log.info("store.write_recovered", state=rec.status.state.value, attempts=failures + 1)
            return

    def _save(self, rec: TargetRecord) -> None:
        self.store.put(rec)

    def _set(self, rec: TargetRecord, state: TargetState, detail: str | None = None) -> None:
        rec.set_state(state, detail)
        self._save(rec)
        _log.info("target." + state.value, capture_id=rec.capture_id, target_id=rec.target_id, detail=detail)

    def _fail(self, rec: TargetRecord, reason: FailureReason, detail: str) -> None:
        rec.fail(reason, detail)
        if rec.key in self._unresolved and rec.lingering_since is None:
            rec.lingering_since = time.time()  # on disk with the failure: a restart right after still watches
        self._save(rec)
        _log.warning("target.failed", capture_id=rec.capture_id, target_id=rec.target_id, reason=reason.value,
                     detail=detail)

    # --- trigger ------------------------------------------------------------------------------

    async def _find_worker(self, rec: TargetRecord) -> Worker | None:
        spec = rec.spec
        give_up = time.time() + self.s.registration_grace_s
        while True:
            worker = self.registry.find(spec.job_id, spec.attempt, spec.registered_rank, pod_uid=spec.pod_uid,
                                        pod=spec.pod)
            if worker is not None or time.time() >= min(give_up, spec.deadline):
                return worker
            await asyncio.sleep(min(0.5, self.s.retry_interval_s))

    async def _live_worker(self, rec: TargetRecord) -> Worker | None:
        """The target's registered, running worker (kept in `rec.worker`), or None with the target
        failed `not_registered` / `process_gone`."""
        spec = rec.spec
        worker = await self._find_worker(rec)
        if worker is None:
            self._fail(rec, R.NOT_REGISTERED, f"no registration record for job {spec.job_id} attempt "
                                              f"{spec.attempt} rank {spec.rank} on node {self.s.node}")
            return None
        if not worker.alive:
            self._fail(rec, R.PROCESS_GONE, f"rank {spec.rank} (pid {worker.record.pid} in "
                                            f"{worker.record.pid_namespace}) is no longer running")
            return None
        rec.worker = worker.to_dict()
        return worker

    async def _trigger(self, rec: TargetRecord, log) -> None:
        spec = rec.spec
        worker = await self._live_worker(rec)
        if worker is None:
            return
        try:
            watch_dir = self._watch_dir(worker) / rec.capture_id
            watch_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(watch_dir, 0o777)  # Kineto writes as the trainer's uid
        except OSError as exc:
            return self._fail(rec, R.INTERNAL_ERROR, f"cannot prepare the trace folder: {exc}")
        no_room = self.disk.refusal(spec, watch_dir, self.claims, rec.key)
        if no_room:
            return self._fail(rec, R.NO_DISK_SPACE, no_room)
        try:
            rec.log_file = log_file_for(worker.record.trace_dir, rec.capture_id, rec.target_id)
            rec.late_start = rec.late_start or start_rules.late_start(spec, time.time())
            config = self._config(rec)
            if rec.late_start:
                log.info("config.late_start", reason=rec.late_start[:300])
        except KinetoConfigError as exc:
            return self._fail(rec, R.INTERNAL_ERROR, f"config refused: {exc}")
        rec.watch_path = str(watch_dir / os.path.basename(kineto_trace_path(rec.log_file, worker.record.pid)))
        rec.backend = self.trigger.name
        if rec.status.state is S.PENDING:
            self._set(rec, S.DISPATCHED)
        last_trigger = spec.deadline - self.s.trace_overhead_s - spec.duration_ms / 1000
        unreachable = 0
        pid, job = worker.record.pid, worker.record.kineto_job_id
        held_by: TargetRecord | None = None      # the last config this one waited behind, for the reasons
        while True:
            if rec.cancelled:
                return self._fail(rec, R.CANCELLED, "cancelled before the config was queued")
            missed = self._missed_before(rec, held_by)
            if missed is not None:
                return self._fail(rec, R.MISSED_START, missed)
            if rec.late_start is None and (late := start_rules.late_start(spec, time.time(), held_by)):
                rec.late_start = late
                config = self._config(rec)
                log.info("config.late_start", reason=late[:300])
            holder = self._holder(rec)
            if holder is not None:
                held_by = holder
                detail = (f"pid {pid}'s Kineto may still hold capture {holder.capture_id} target {holder.target_id}'s "
                          f"config (queued at {_iso(holder.queued_at)}, no trace from it yet; {_holding(holder)}): "
                          f"Kineto would ignore a config sent now, so this one waits")
                if rec.status.state is not S.WAITING_FOR_SLOT or rec.status.detail != detail:
                    self._set(rec, S.WAITING_FOR_SLOT, detail)
                answer = None
            else:
                try:
                    # rec.trace_id is set only when queued again after a restart (Agent.start)
                    answer = await self.trigger.request(config, pid, job, trace_id=rec.trace_id,
                                                        moot_if=rec.watch_path if rec.trace_id else None)
                    unreachable = 0
                    new_entry = rec.status.record_attempt(_attempt(self.trigger.name, answer.result))
                except TriggerFailed as exc:
                    new_entry = rec.status.record_attempt(TriggerAttempt(time.time(), self.trigger.name, error=exc.reason))
                    if exc.reason != R.DYNOLOG_UNREACHABLE.value or not exc.retryable:
                        return self._fail(rec, R(exc.reason), exc.detail)
                    unreachable += 1
                    if unreachable >= self.s.unreachable_attempts:
                        return self._fail(rec, R.DYNOLOG_UNREACHABLE, f"{exc.detail} ({unreachable} attempts)")
                    answer = None
                if new_entry and (answer is None or answer.outcome is not PidOutcome.QUEUED):
                    self._save(rec)  # a new answer is a fact worth keeping even when the state stays
            if answer is not None and answer.outcome is PidOutcome.QUEUED:
                rec.trace_id, rec.queued_at = answer.trace_id, time.time()
                self._unresolved[rec.key] = rec
                return self._set(rec, S.QUEUED_BY_DYNOLOG,
                                 f"config for pid {pid} (job {job}) is in its pending slot via {self.trigger.name}; "
                                 f"expecting {os.path.basename(rec.watch_path)}"
                                 + (f"; every rank starts at iteration {spec.start_iteration}"
                                    if spec.start_iteration is not None else ""))
            if answer is not None:
                waiting = answer.outcome in (PidOutcome.WAITING_FOR_SLOT, PidOutcome.LIMITED)
                state = S.WAITING_FOR_SLOT if waiting else S.NOT_MATCHED
                detail = (f"pid {pid} matched but an earlier config is still pending (busy {answer.result.activity_busy})"
                          if waiting else f"no process with pid {pid} registered for job {job} (yet)")
                if rec.status.state is not state:
                    self._set(rec, state, detail)
            if time.time() >= last_trigger:
                if rec.status.state is S.WAITING_FOR_SLOT:
                    return self._fail(rec, R.BUSY_TIMEOUT, (rec.status.detail or "busy") + " until the deadline")
                if rec.status.state is S.NOT_MATCHED:
                    return self._fail(rec, R.NOT_MATCHED, rec.status.detail or "never matched")
                return self._fail(rec, R.DYNOLOG_UNREACHABLE, "the trigger backend did not answer before the deadline")
            if not self._alive(rec):
                return self._fail(rec, R.PROCESS_GONE, f"pid {pid} exited before its config was queued")
            await asyncio.sleep(self.s.retry_interval_s)

    def _config(self, rec: TargetRecord) -> str:
        """The Kineto config for `rec`: at the capture's chosen instant, or on Kineto's own clock once
        that instant can no longer be met (`rec.late_start`)."""
        spec = rec.spec
        while True:
            start_ms = 0 if spec.iterations or rec.late_start else (spec.start_time_ms or 0)
            try:
                return build_config(TraceConfig(rec.log_file, spec.duration_ms, spec.activities, spec.options,
                                                start_time_ms=start_ms, iterations=spec.iterations or 0,
                                                iteration_roundup=spec.iteration_roundup or 1,
                                                start_iteration=spec.start_iteration,
                                                max_gpu_buffer_mb=spec.budget.gpu_buffer_mb if spec.budget else None))
            except KinetoConfigError as exc:
                if exc.field != "start_time_ms" or not start_ms:
                    raise
                rec.late_start = start_rules.late_start(spec, time.time()) or str(exc)   # crossed the line just now

    def _watch_dir(self, worker: Worker) -> Path:
        """Where the agent sees the trainer's trace dir: its own --trace-dir when that is the same
        folder (shared hostPath), else through the trainer's root (/proc/<pid>/root)."""
        return agent_view(worker.record.trace_dir, self.s.trace_dir, worker.host_pid)

    def _holder(self, rec: TargetRecord) -> TargetRecord | None:
        """Another target whose config is still out with this same process (queued, no trace yet)."""
        me = _process_key(rec.worker)
        if me is None:
            return None
        now = time.time()
        for other in self._unresolved.values():
            if other.key != rec.key and _process_key(other.worker) == me and start_rules.holds_process(other, now):
                return other
        return None

    def _step_log(self, rec: TargetRecord) -> StepLog | None:
        try:
            return self.registry.steps((rec.worker or {}).get("steps_file"))
        except StepsUnreadable:
            return None

    def _missed_before(self, rec: TargetRecord, held_by: TargetRecord | None) -> str | None:
        """Before queueing: can this config still start where the capture starts every rank?"""
        return start_rules.missed_before(rec.spec, self._step_log(rec), time.time(), held_by)

    # --- observe ------------------------------------------------------------------------------

    async def _observe(self, rec: TargetRecord, log) -> None:
        spec = rec.spec
        assert rec.watch_path is not None
        host_pid = (rec.worker or {}).get("host_pid")
        while True:
            remaining = spec.deadline - time.time()
            found = await self.observer.wait_for(rec.watch_path, min(self.s.liveness_interval_s, max(0.0, remaining)))
            if found is not None:
                return self._landed(rec, found)
            if rec.kineto_refusal is not None:  # Kineto's polls say it dropped the config (builtin)
                if start_rules.tmp_being_written(rec.watch_path):   # a stronger fact: it is writing this very trace
                    log.info("kineto.refusal_disproved", detail=rec.kineto_refusal[:200])
                    rec.kineto_refusal = None
                    continue
                found = await self.observer.wait_for(rec.watch_path, min(1.0, self.s.liveness_interval_s))
                if found is None:
                    return self._fail(rec, R.KINETO_REFUSED, f"{rec.kineto_refusal}; no {rec.watch_path}")
                return self._landed(rec, found)
            if time.time() >= spec.deadline:
                return await self._no_trace(rec)
            if host_pid and not self._alive(rec):
                found = await self.observer.wait_for(rec.watch_path, self.s.liveness_interval_s)  # a last look
                if found is None:
                    return self._fail(rec, R.PROCESS_GONE, f"pid {rec.worker['pid']} exited before its trace appeared")
                return self._landed(rec, found)

    def _landed(self, rec: TargetRecord, found: ObservedFile) -> None:
        """The trace is under its final name: Kineto holds nothing of this config any more."""
        rec.observed_at = found.observed_at
        self._observed_after(found)
        self._unresolved.pop(rec.key, None)
        if self.trigger.retract(rec.trace_id):
            # queued again after a restart while Kineto traced the earlier copy: this is its trace,
            # and the copy still in the slot would trace the rank a second time into this file
            _log.info("target.duplicate_config_retracted", capture_id=rec.capture_id, target_id=rec.target_id,
                      trace_id=rec.trace_id)
        self.trigger.settle(rec.trace_id)
        self._set(rec, S.TRACE_OBSERVED, f"{found.path} ({found.size} bytes)")

    def _observed_after(self, found: ObservedFile) -> None:
        try:
            written = os.stat(found.path).st_mtime
        except OSError:
            return
        self.metrics.observation_delay.observe(max(0.0, found.observed_at - written))

    async def _no_trace(self, rec: TargetRecord) -> None:
        """No file by the deadline: `dynolog_lost` when the dynolog that queued the config no longer
        answers (its pending slot died with it), else `trace_timeout` (Kineto did not write)."""
        spec = rec.spec
        missing = f"queued at {_iso(rec.queued_at)}, but no {rec.watch_path} by the deadline {_iso(spec.deadline)}"
        last = rec.status.trigger_attempts[-1].describe() if rec.status.trigger_attempts else "none recorded"
        if rec.backend == "builtin" and rec.delivered_at is None and self.trigger.retract(rec.trace_id):
            self._unresolved.pop(rec.key, None)    # taken back from the slot: it can never start now
            missing += " (taken back from the endpoint's slot unfetched, so it can never start late)"
        if rec.kineto_behind is not None and self.trigger.holds_unstarted(rec.kineto_behind_id):
            return self._fail(rec, R.KINETO_REFUSED,
                              f"{rec.kineto_behind}; that earlier config had still not started at the deadline and "
                              f"this one left no file: Kineto ignored it ({missing})")
        gone = await self.trigger.lost() if rec.backend == self.trigger.name else None
        if gone is not None:
            return self._fail(rec, R.DYNOLOG_LOST,
                              f"{missing}; {gone.detail} now, so the pending config was lost with it (dynolog died or "
                              f"restarted: check the dynolog pod or service on node {self.s.node}, then capture again); "
                              f"last answer: {last}")
        behind = (f"; when Kineto fetched it, it still held an earlier config ({rec.kineto_behind}), which has since "
                  f"started or landed" if rec.kineto_behind else "")
        return self._fail(rec, R.TRACE_TIMEOUT, f"{missing}; {_timeout_hint(rec)}{behind}; last answer: {last}")

    def _alive(self, rec: TargetRecord) -> bool:
        w = rec.worker or {}
        return self.registry.is_same_process(w.get("host_pid"), w.get("pid"), w.get("pid_namespace"),
                                             w.get("start_time"))

    # --- verify -------------------------------------------------------------------------------

    def _expectation(self, rec: TargetRecord, observed_at: float | None) -> Expectation:
        spec = rec.spec
        return Expectation(
            activities=tuple(spec.activities),
            window_start=rec.accepted_at - self.s.clock_slack_s,
            window_end=(observed_at or time.time()) + self.s.clock_slack_s,
            duration_ms=spec.duration_ms,
            with_stack=spec.options.with_stack,
            pid=(rec.worker or {}).get("pid"),
            trace_id=rec.trace_id if rec.backend == "builtin" else None,
            iterations=spec.iterations,
        )

    async def _run_verifier(self, rec: TargetRecord, path: str, exp: Expectation, *, stage: bool = True) -> Verdict:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        verdict = await loop.run_in_executor(self.verify_pool, functools.partial(
            verify_trace, path, exp, stage=self.disk.staging(rec.capture_id, rec.target_id) if stage else None))
        self.metrics.verified(verdict.size or 0, time.monotonic() - started)
        return verdict

    async def _verify(self, rec: TargetRecord, log) -> None:
        spec = rec.spec
        path = rec.watch_path
        assert path is not None
        verdict = await self._run_verifier(rec, path, self._expectation(rec, rec.observed_at))
        rec.verdict = verdict.to_dict()
        collection = rec.verdict.pop("collection", None)   # mapped to step numbers or kept as the window below
        if not spec.iterations and collection:
            rec.verdict["window_start"], rec.verdict["window_end"] = collection[0], collection[1]
        if not verdict.ok and verdict.empty:
            return await self._keep_empty(rec, verdict, log)
        if not verdict.ok:
            return self._fail(rec, R.VERIFICATION_FAILED, f"{verdict.detail} (file kept at {path})")
        raw_note = ""
        if verdict.stage_error:
            # the gzip copy hit the disk's reserve: the trace itself is fine and is this rank's
            # evidence; archive it as it is (one more read, for the raw bytes' checksum)
            log.warning("trace.stage_failed", error=verdict.stage_error[:300])
            raw_note = f"; archived uncompressed: {verdict.stage_error}"
            kept = {k: rec.verdict[k] for k in ("window_start", "window_end") if k in rec.verdict}
            verdict = await self._run_verifier(rec, path, self._expectation(rec, rec.observed_at), stage=False)
            rec.verdict = verdict.to_dict() | kept | {"unstaged": raw_note[2:]}
            rec.verdict.pop("collection", None)
            if not verdict.ok:
                return self._fail(rec, R.VERIFICATION_FAILED, f"{verdict.detail} (file kept at {path})")
        if rec.trace_id is None:
            rec.trace_id = verdict.trace_id
        if spec.iterations:
            traced = self._traced_steps(rec, verdict)
            if traced is not None:
                # Kineto stops a collection at its own pace (a busy trainer's profiler thread can be
                # a step or two late): the capture's iterations are the requested ones from the
                # first; `collected_last` keeps how far the collection really went
                last = traced[0] + spec.iterations - 1 if traced[1] - traced[0] + 1 >= spec.iterations else traced[1]
                rec.verdict.update(step_first=traced[0], step_last=last, step_collected_last=traced[1])
            wrong = start_rules.misaligned(spec, traced)
            if wrong is not None:
                return await self._keep_misaligned(rec, verdict, wrong, log)
        detail = f"{verdict.event_count} events, {verdict.size} bytes, sha256 {verdict.sha256[:12]}{raw_note}"
        if spec.iterations and not verdict.optimizer_steps and rec.verdict.get("step_first") is None:
            detail += "; NOT an iteration trace: the process never stepped an optimizer"
            log.warning("trace.not_stepping", pid=(rec.worker or {}).get("pid"), iterations=spec.iterations)
        self._set(rec, S.VERIFIED, detail)

    async def _keep_misaligned(self, rec: TargetRecord, verdict: Verdict, wrong: str, log) -> None:
        """A trace that started at another iteration than the capture's is not the capture's photo,
        but it is still this rank's evidence: archived beside the capture's traces as
        `traces/<target>.misaligned.json[.gz]` (never an artifact of the manifest), the target failed
        `missed_start` with the steps it holds and where it is. Kept on the node if the archive fails."""
        path = rec.watch_path or ""
        stored = Path(verdict.stored_path or path)
        key = archive_key(self.s.archive_root, rec.spec.archive_prefix, rec.target_id,
                          ".json.gz" if verdict.encoding == "gzip" else ".json", tag="misaligned")
        try:
            uri = await put_file_retrying(self.archive, stored, key, policy=self.s.archive_policy)
        except ArchiveError as exc:
            log.warning("trace.misaligned_not_archived", error=str(exc)[:300])
            if stored != Path(path):
                stored.unlink(missing_ok=True)
            return self._fail(rec, R.MISSED_START, f"{wrong}; the trace could not be archived ({exc}): kept at {path}")
        for local in {Path(path), stored}:
            local.unlink(missing_ok=True)          # in the archive now
        log.info("trace.misaligned_archived", uri=uri)
        return self._fail(rec, R.MISSED_START, f"{wrong}; that trace is archived as this rank's evidence at {uri} "
                                               f"(sha256 {verdict.sha256[:12]}, not part of the capture)")

    async def _keep_empty(self, rec: TargetRecord, verdict: Verdict, log) -> None:
        """A trace of this request with no activity in it: the rank did nothing Kineto traces for
        the whole window, i.e. it was blocked (in a collective, a lock, I/O). That emptiness is the
        evidence, so the file is archived beside the capture's traces as `traces/<target>.empty.json`
        (never an artifact of the manifest: there is nothing in it to analyse) and the target fails
        `trace_empty` saying where it is; kept on the node if the archive fails (issue 45)."""
        path = Path(rec.watch_path or "")
        key = archive_key(self.s.archive_root, rec.spec.archive_prefix, rec.target_id, ".json", tag="empty")
        blocked = (f"the trace holds no {', '.join(rec.spec.activities)} event: the rank did no traced work for the "
                   f"whole window, so it was blocked (in a collective, a lock, I/O); a hang capture "
                   f"(gpulens capture start --hang) names where")
        try:
            sha = await asyncio.get_running_loop().run_in_executor(self.verify_pool, _sha256_of, str(path))
            uri = await put_file_retrying(self.archive, path, key, policy=self.s.archive_policy)
        except (ArchiveError, OSError) as exc:
            log.warning("trace.empty_not_archived", error=str(exc)[:300])
            return self._fail(rec, R.TRACE_EMPTY, f"{blocked}; the trace could not be archived ({exc}): kept at {path}")
        path.unlink(missing_ok=True)          # in the archive now
        log.warning("trace.empty_archived", uri=uri, size=verdict.size)
        return self._fail(rec, R.TRACE_EMPTY, f"{blocked}; the empty trace is archived as this rank's evidence at "
                                              f"{uri} ({verdict.size} bytes, sha256 {sha[:12]}; not part of the capture)")

    def _traced_steps(self, rec: TargetRecord, verdict: Verdict) -> tuple[int, int] | None:
        """The first and last optimizer step (the hook's count) whose work the trace holds, from
        Kineto's own collection span ("PyTorch Profiler (0)", there whatever the activity types).
        None when the process publishes no counter, the trace has no such span, or the hook's ring
        no longer reaches back to it."""
        steps = self._step_log(rec)
        if steps is None:
            return None
        if verdict.collection is None:
            return None
        return steps.steps_during(*verdict.collection)

    # --- archive ------------------------------------------------------------------------------

    async def _archive(self, rec: TargetRecord, log) -> None:
        spec, verdict, worker = rec.spec, rec.verdict or {}, rec.worker or {}
        path = Path(rec.watch_path or "")
        try:
            size = path.stat().st_size
        except OSError as exc:
            return self._fail(rec, R.ARCHIVE_FAILED, f"verified file vanished before archiving: {exc}")
        if size != verdict.get("size"):
            return self._set(rec, S.TRACE_OBSERVED, f"{path} changed after verification ({size} bytes); verifying again")
        stored = Path(verdict.get("stored_path") or path)
        if not stored.is_file():
            return self._set(rec, S.TRACE_OBSERVED, f"the archive copy {stored} is gone; verifying again")
        key = archive_key(self.s.archive_root, spec.archive_prefix, rec.target_id,
                          ".json.gz" if verdict.get("encoding") == "gzip" else ".json")

        def retrying(attempt: int, exc: ArchiveError, pause: float) -> None:
            rec.status.detail = f"archive attempt {attempt} failed ({exc}); retrying in {pause:.1f} s"
            rec.status.updated_at = time.time()
            try:
                self._save(rec)
            except StoreWriteFailed:
                pass  # only a progress note; the next state change is written (and retried) in full
            self.metrics.archive_retries.inc()
            log.warning("archive.retry", attempt=attempt, error=str(exc)[:300])

        try:
            uri = await put_file_retrying(self.archive, stored, key, policy=self.s.archive_policy, on_retry=retrying)
        except ArchiveError as exc:
            return self._fail(rec, R.ARCHIVE_FAILED, f"{exc} (file kept at {path})")
        finally:
            if stored != path:
                stored.unlink(missing_ok=True)   # the staged copy: in the store now, or given up with the target
        rec.status.artifact = Artifact(
            target_id=rec.target_id, rank=spec.rank, local_rank=int(worker.get("local_rank", spec.local_rank or 0)),
            node=self.s.node, pod=str(worker.get("pod", spec.pod or "")), pid=int(worker["pid"]),
            attempt=spec.attempt, uri=uri, size=int(verdict.get("stored_size") or verdict["size"]),
            sha256=verdict["sha256"], sizes=artifact_sizes(spec, verdict),
            trace_id=rec.trace_id, event_count=verdict.get("event_count"),
            iterations=None if not spec.iterations else start_rules.iterations_of(spec, verdict), worker_rank=spec.worker_rank,
            window=start_rules.window_of(spec, verdict, rec.late_start))
        note = ""
        if rec.status.artifact.iterations and rec.status.artifact.iterations["numbering"] == "optimizer_step":
            it = rec.status.artifact.iterations
            note = f"; optimizer steps {it['first']}..{it['last']}"
        elif rec.status.artifact.iterations and not rec.status.artifact.iterations["stepped"]:
            note = (f"; NOT {spec.iterations} iterations: the process never stepped an optimizer, so Kineto "
                    f"traced a short time window instead")
        if verdict.get("unstaged"):
            note += f"; {verdict['unstaged']}"
        self._set(rec, S.ARCHIVED, f"archived to {uri}{note}")  # the local copy goes only once this is on disk (run)

    # --- a hang capture: the rank's evidence, no Kineto (issue 45) -------------------------------

    async def _hang(self, rec: TargetRecord, log) -> None:
        spec = rec.spec
        worker = await self._live_worker(rec)
        if worker is None:
            return
        if rec.status.state is S.PENDING:
            self._set(rec, S.DISPATCHED, "asking the rank's hook for its Flight Recorder dump, then reading its stacks")
        trace_view = self._watch_dir(worker)
        try:    # the agent's own folder for the hook's dump: the agent (no DAC_OVERRIDE) can remove it after
            (trace_view / rec.capture_id).mkdir(parents=True, exist_ok=True)
            os.chmod(trace_view / rec.capture_id, 0o777)   # the hook writes as the trainer's uid
        except OSError as exc:
            return self._fail(rec, R.INTERNAL_ERROR, f"cannot prepare the folder for the hook's dump: {exc}")
        rec.watch_path = str(flight_dump_path(trace_view, rec.capture_id, rec.target_id))   # its folder goes last
        target = hang_capture.hang_target(rec.capture_id, rec.target_id, spec.rank, worker,
                                          trace_view=trace_view, socket_dir=self.s.socket_dir)
        doc = await collect_hang_evidence(target, flight_timeout_s=self.s.flight_timeout_s)
        log.info("hang.evidence", rank=spec.rank, dump=doc["flight_recorder"]["reason"] or "taken",
                 stacks=doc["stacks"]["reason"] or "taken", seconds=doc["seconds"])
        missing = hang_capture.nothing_taken(doc)
        if missing:
            return self._fail(rec, R.NO_HANG_EVIDENCE, missing)
        data, sha = hang_capture.evidence_bytes(doc)
        self.disk.staging_dir.mkdir(parents=True, exist_ok=True)
        local = self.disk.staging_dir / f"{rec.capture_id}.{rec.target_id}.hang.json"
        try:
            local.write_bytes(data)
        except OSError as exc:
            return self._fail(rec, R.NO_DISK_SPACE if exc.errno == 28 else R.INTERNAL_ERROR,
                              f"the hang evidence ({len(data)} bytes) could not be staged at {local}: {exc}")
        key = archive_key(self.s.archive_root, spec.archive_prefix, rec.target_id, hang_capture.HANG_SUFFIX,
                          tag=hang_capture.HANG_TAG)
        try:
            uri = await put_file_retrying(self.archive, local, key, policy=self.s.archive_policy)
        except ArchiveError as exc:
            return self._fail(rec, R.ARCHIVE_FAILED, f"the hang evidence could not be archived: {exc}")
        finally:
            local.unlink(missing_ok=True)
        rec.status.artifact = Artifact(
            target_id=rec.target_id, rank=spec.rank, local_rank=int(worker.record.local_rank),
            node=self.s.node, pod=worker.record.pod or spec.pod or "", pid=worker.record.pid,
            attempt=spec.attempt, uri=uri, size=len(data), sha256=sha, trace_id=None,
            worker_rank=spec.worker_rank, kind="hang_evidence",
            sizes={"budget": None, "estimate": None, "uncompressed": len(data), "stored": len(data),
                   "encoding": "identity", "gpu_buffer_mb": None, "stopped_early": None})
        self._set(rec, S.ARCHIVED, f"hang evidence archived to {uri}: {hang_capture.describe(doc)}")

    # --- after the end: a late trace is archived, never lost ------------------------------------

    async def _linger(self, rec: TargetRecord, log, resumed: bool = False) -> None:
        """The target ended without its trace, but its config reached Kineto's side: Kineto may
        still write it (a refusal misjudged, a trace that outran the deadline). Until the file lands
        or it is proven never to come, the capture's folder stays (so the trainer never hits
        ENOENT) and this process gets no other config; a file that does land is verified and
        archived as `traces/<target>.late.json`, and the target's detail says so."""
        if rec.lingering_since is None:       # (set with the failure as a rule; on disk, so a restart watches on)
            rec.lingering_since = time.time()
            self._save_quietly(rec, log)
        began = rec.lingering_since
        log.info("target.lingering", reason=rec.status.reason.value if rec.status.reason else None,
                 resumed=resumed, since_s=round(time.time() - began, 1))
        passed_at: list[float] = []
        # Every way out but cancellation (an agent stopping) settles the watch on disk; a stop
        # leaves it there for the next agent to resume.
        while True:
            found = await self.observer.wait_for(rec.watch_path, self.s.liveness_interval_s)
            if found is not None:
                self.trigger.settle(rec.trace_id)
                rec.lingering_since = None     # saved with the late trace's detail
                return await self._archive_late(rec, found, log)
            why = self._never_written(rec, passed_at)
            if why is not None:
                log.info("target.config_resolved", why=why)
                break
            if time.time() - began >= self.s.linger_max_s:
                log.warning("target.linger_expired", waited_s=round(time.time() - began),
                            hint="a trace Kineto writes later finds no folder; the trainer's log will say so")
                break
        rec.lingering_since = None
        self._save_quietly(rec, log)

    def _save_quietly(self, rec: TargetRecord, log) -> None:
        """Persist a fact that only adds to a final status; a failed write is logged, never raised."""
        try:
            self._save(rec)
        except (StoreWriteFailed, FinalStatusConflict) as exc:
            log.error("store.write_failed", state=rec.status.state.value, error=str(exc)[:300])

    def _never_written(self, rec: TargetRecord, passed_at: list[float]) -> str | None:
        """Why this config's trace can no longer appear, or None while it still might."""
        if not self._alive(rec):
            return "the process exited"
        return start_rules.never_written(rec, self._step_log(rec), time.time(), passed_at,
                                         poll_s=self.s.kineto_poll_s, write_s=self.s.linger_write_s)

    async def _archive_late(self, rec: TargetRecord, found: ObservedFile, log) -> None:
        path = Path(found.path)
        verdict = await self._run_verifier(rec, found.path, self._expectation(rec, found.observed_at), stage=False)
        key = archive_key(self.s.archive_root, rec.spec.archive_prefix, rec.target_id, ".json", late=True)
        try:
            uri = await put_file_retrying(self.archive, path, key, policy=self.s.archive_policy)
        except ArchiveError as exc:
            log.error("trace.late_archive_failed", path=str(path), error=str(exc)[:300])
            return   # kept on disk where it landed; the folder stays with it
        rec.late_uri = uri
        rec.status.detail = (f"{rec.status.detail or ''}; a late trace landed at {_iso(found.observed_at)}, after this "
                             f"target had ended, and was archived to {uri} "
                             f"({'verified' if verdict.ok else 'NOT verified: ' + verdict.detail}; not in the manifest)")
        rec.status.updated_at = time.time()
        try:
            self._save(rec)      # the same final state and reason: only the detail grows
        except (StoreWriteFailed, FinalStatusConflict) as exc:
            log.error("store.write_failed", state=rec.status.state.value, error=str(exc)[:300])
        self.metrics.late_traces.inc()
        log.warning("trace.late", uri=uri, verified=verdict.ok, size=found.size)
        if not self.s.keep_local:
            try:
                path.unlink()
            except OSError:
                pass

    def _drop_local(self, rec: TargetRecord) -> None:
        """An archived file goes; the capture's folder goes with the last of the capture's targets on
        this node, whatever its outcome (a kept file, e.g. one that failed verification, keeps it),
        once none of them lingers for a late trace. Never earlier: Kineto opens its file when its
        trace *starts*, which may be after another rank's trace was archived."""
        if rec.watch_path is None:
            return   # it ended before a folder was prepared for it
        path = Path(rec.watch_path)
        if rec.status.state is S.ARCHIVED:
            try:
                path.unlink()
            except OSError:
                pass
        if any(not other.status.terminal or other.key in self._unresolved
               for other in self.store.capture(rec.capture_id) if other.target_id != rec.target_id):
            return
        try:
            path.parent.rmdir()  # only when empty
        except OSError:
            pass

def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _holding(rec: TargetRecord) -> str:
    """What is known of a config still out with its process: the facts a waiting target names."""
    tmp = bool(rec.watch_path) and os.path.exists(rec.watch_path + ".tmp")
    facts = [f"ended {rec.status.reason.value}" if rec.status.terminal and rec.status.reason else "in flight",
             f"fetched {_iso(rec.delivered_at)}" if rec.delivered_at else "fetch not seen",
             f"polls busy from {_iso(rec.kineto_started_at)}" if rec.kineto_started_at else "never seen busy",
             "its .tmp is on disk (Kineto is writing it)" if tmp else "no .tmp"]
    return ", ".join(facts)


def _process_key(worker: dict | None) -> tuple | None:
    """One process, whatever record names it: its host pid, its own pid and start time."""
    if not worker or not worker.get("host_pid"):
        return None
    return worker.get("host_pid"), worker.get("pid"), worker.get("start_time")


def _attempt(backend: str, result: OnDemandResult) -> TriggerAttempt:
    return TriggerAttempt(time.time(), backend, processes_matched=list(result.processes_matched),
                          triggered=list(result.activity_triggered), busy=result.activity_busy)


def _iso(t: float | None) -> str:
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(t)) + "Z"


def _timeout_hint(rec: TargetRecord) -> str:
    """What to check next: Kineto reports its own refusals (e.g. "insufficient time for warmup")
    only in the trainer's log, never back over IPC or to dynolog. Permissions are one cause of
    several, so the hint names each place to look."""
    pid = (rec.worker or {}).get("pid", "?")
    if rec.backend == "builtin" and rec.delivered_at is None:
        return (f"Kineto in pid {pid} never fetched the config (is the trainer armed with KINETO_USE_DAEMON=1 and "
                "KINETO_IPC_SOCKET_DIR = the agent's --socket-dir? is its training loop stuck?)")
    if rec.kineto_idle_at is not None:
        return (f"Kineto fetched the config at {_iso(rec.delivered_at)}, traced from {_iso(rec.kineto_started_at)} "
                f"and was idle again at {_iso(rec.kineto_idle_at)}, but wrote no file there: the trainer's trace dir "
                "must exist and be writable, newer Kineto writes only under KINETO_ONDEMAND_TRACE_DIR (else /tmp), and "
                f"a torch.profiler session in the trainer cancels on-demand traces (pid {pid}'s log says which)")
    if rec.kineto_started_at is not None:
        return (f"Kineto fetched the config at {_iso(rec.delivered_at)} and started tracing by "
                f"{_iso(rec.kineto_started_at)}, but had not finished by the deadline (see pid {pid}'s log)")
    if rec.backend == "builtin" and rec.spec.iterations:
        return (f"Kineto fetched the config at {_iso(rec.delivered_at)} and never started it: an iteration-aligned "
                f"trace waits for its start iteration (a multiple of the round-up), so pid {pid} did not step that far "
                "by the deadline, or its log says why it was ignored")
    if rec.backend == "builtin":
        fetched = f"Kineto fetched the config at {_iso(rec.delivered_at)} but wrote no trace"
    else:
        fetched = "dynolog still answers (it cannot say whether Kineto fetched the config) and Kineto wrote no trace"
    return (f"{fetched}: look for Kineto's own refusal (e.g. 'insufficient time for warmup') in the trainer's log "
            f"for pid {pid}; a torch.profiler session in the training code pre-empts on-demand traces; the trainer "
            f"may be stuck; or the trace folder is not writable for the trainer")
