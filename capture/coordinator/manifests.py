"""The capture's receipt: build the manifest from what the agents reported, check it, write it.

An agent's artifact is believed only if it names the right target and rank and lies under this
capture's archive prefix; anything else is a `verification_failed` target, never an artifact.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from gpulens.capture.archive import ArchiveError, ArchiveStore, open_archive, under_prefix
from gpulens.capture.models import Artifact, ExpectedTarget, Failure, FailureReason, Manifest, TargetState

from .progress import CaptureRecord

__all__ = ["capture_prefix", "check_artifacts", "build_manifest", "write_manifest"]


def capture_prefix(archive_root: str, namespace: str, job_id: str, attempt: int, capture_id: str) -> str:
    """<archive root>/<namespace>/<job>/<attempt>/<capture_id> (docs/ARCHITECTURE.md, "Archive layout")."""
    return f"{archive_root.rstrip('/')}/{namespace}/{job_id}/{attempt}/{capture_id}"


def _artifact_problem(record: CaptureRecord, target_id: str, a: Artifact | None) -> str | None:
    p = record.targets[target_id]
    if a is None:
        return "the agent reported 'archived' without an artifact"
    if a.target_id != target_id or a.rank != p.target.rank:
        return f"the agent's artifact names {a.target_id} (rank {a.rank}), not {target_id} (rank {p.target.rank})"
    if a.attempt != record.attempt:
        return f"the artifact belongs to attempt {a.attempt}, not {record.attempt}"
    if not under_prefix(record.archive_prefix, a.uri):
        return f"the artifact {a.uri} lies outside this capture's prefix {record.archive_prefix}"
    return None


def check_artifacts(record: CaptureRecord) -> None:
    """Turn archived targets whose artifact does not add up into verification_failed ones."""
    for tid, p in record.targets.items():
        if p.state == TargetState.ARCHIVED:
            problem = _artifact_problem(record, tid, p.artifact)
            if problem:
                p.status.state = TargetState.PENDING  # reopen, then fail through the one door that publishes
                record.update(tid, TargetState.FAILED, FailureReason.VERIFICATION_FAILED, problem)


def build_manifest(record: CaptureRecord) -> Manifest:
    targets = sorted(record.targets.values(), key=lambda p: p.target.rank)
    expected = [ExpectedTarget(p.target.target_id, p.target.rank, p.target.local_rank, p.target.pod, p.target.node)
                for p in targets]
    artifacts = [p.artifact for p in targets if p.state == TargetState.ARCHIVED and p.artifact is not None]
    failures = [Failure(p.target.target_id, (p.reason or FailureReason.INTERNAL_ERROR).value,
                        p.detail or "", p.target.rank)
                for p in targets if p.state != TargetState.ARCHIVED]
    request = dict(record.request.to_dict(), namespace=record.namespace, capture_id=record.capture_id)
    if record.budget is not None:      # issue 27: what the budget made of the request, and why
        request["budget"] = record.budget.to_dict()
    return Manifest(capture_id=record.capture_id, job_id=record.job_id, attempt=record.attempt,
                    requested_at=record.requested_at, duration_ms=record.request.duration_ms,
                    expected_targets=expected, artifacts=artifacts, failures=failures,
                    deadline=record.deadline, converged_at=record.converged_at, request=request,
                    archive_prefix=record.archive_prefix, start_time_ms=record.start_time_ms)


async def write_manifest(manifest: Manifest, prefix: str, *, attempts: int = 4, backoff_s: float = 1.0,
                         open_store: Callable[[str], ArchiveStore] = open_archive) -> str:
    """Validate (Manifest.to_json does) and write <prefix>/manifest.json; retry what may heal."""
    # schema validation of a 1,000-target manifest takes ~0.3 s of CPU: keep it off the event loop
    body = (await asyncio.to_thread(manifest.to_json)).encode()
    store = open_store(prefix)
    for i in range(attempts):
        try:
            return await asyncio.to_thread(store.put_bytes, body, "manifest.json")
        except ArchiveError as exc:
            if not exc.retryable or i == attempts - 1:
                raise
            await asyncio.sleep(backoff_s * 2 ** i)
    raise ArchiveError("unreachable")
