"""Target statuses as level-triggered facts on local disk: an agent restart loses none.

One JSON file per (capture, target) under `<state dir>/captures/<capture_id>/<target_id>.json`,
replaced atomically (temp file, fsync, rename, fsync of the directory) on every transition, so a
crash leaves either the old or the new fact, never half of one. Besides the public `TargetStatus`
the file keeps what the agent needs to resume: the dispatch, the worker it resolved, the log file
it asked for, the trace id, and the verdict.

What the API shows is what is on disk: `status()`/`statuses()` answer the last status that was
written, never a newer one still in memory. A write that fails (full disk, read-only folder)
raises `StoreWriteFailed`, leaves no temp file, publishes nothing; the pipeline retries it. A
target whose final status is on disk never gets a different one (`FinalStatusConflict`). A file
that is not a target record of the folder and name it sits under is moved aside at start-up
(gpulens.capture.statefiles).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulens.ground.logs import get_logger

from ..wire import limits
from ..models import Dispatch, FailureReason, TargetState, TargetStatus
from ..statefiles import load_or_move_aside

__all__ = ["TargetRecord", "StatusStore", "StoreWriteFailed", "FinalStatusConflict", "CAPTURE_ID_RE", "TARGET_ID_RE"]

_log = get_logger("agent")

# full-match only (\A...\Z, fullmatch): `$` would also accept a trailing newline
CAPTURE_ID_RE = re.compile(r"\A[a-z0-9][a-z0-9-]{7,62}\Z")       # as capture_request.schema.json
TARGET_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")  # e.g. rank-12; no dots: it names files


@dataclass
class TargetRecord:
    capture_id: str
    target_id: str
    dispatch: dict[str, Any]
    status: TargetStatus
    accepted_at: float = field(default_factory=time.time)
    backend: str | None = None
    worker: dict[str, Any] | None = None   # the registration record, host_pid resolved
    log_file: str | None = None            # what Kineto was asked to write (trainer's view)
    watch_path: str | None = None          # where the final file appears (agent's view)
    trace_id: str | None = None            # the id the agent set (builtin); the file's otherwise
    queued_at: float | None = None
    delivered_at: float | None = None      # builtin only: Kineto fetched the config
    kineto_started_at: float | None = None  # builtin only: Kineto's polls turned busy (warm-up began)
    kineto_idle_at: float | None = None     # builtin only: ...and idle again (that trace is over)
    kineto_refusal: str | None = None       # builtin only: why Kineto's polls show it dropped the config
    kineto_behind: str | None = None        # builtin only: Kineto held an earlier unstarted config when it fetched this one
    kineto_behind_id: str | None = None     # ... that config's trace id (refused only if it is still held at the deadline)
    late_start: str | None = None           # wall clock: why the config went out with Kineto's own start, not the chosen one
    late_uri: str | None = None             # a trace that landed after the target ended, archived here
    lingering_since: float | None = None    # ended, its config out there: watched for a late trace since (a restart resumes it)
    observed_at: float | None = None
    verdict: dict[str, Any] | None = None
    cancelled: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.capture_id, self.target_id

    @property
    def spec(self) -> Dispatch:
        return Dispatch.from_dict(self.dispatch)

    def set_state(self, state: TargetState, detail: str | None = None) -> None:
        self.status.state, self.status.detail, self.status.updated_at = state, detail, time.time()
        self.status.reason = None

    def fail(self, reason: FailureReason, detail: str) -> None:
        self.status.state, self.status.reason = TargetState.FAILED, reason
        self.status.detail, self.status.updated_at = detail, time.time()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TargetRecord":
        d = dict(data)
        d["status"] = TargetStatus.from_dict(d["status"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


class StoreWriteFailed(OSError):
    """A state change did not reach the disk; nothing of it was published or left behind."""


class FinalStatusConflict(RuntimeError):
    """A target whose final status is on disk was about to get a different one."""


class StatusStore:
    def __init__(self, state_dir: Path):
        self.root = Path(state_dir) / "captures"
        self.root.mkdir(parents=True, exist_ok=True)
        self._records: dict[tuple[str, str], TargetRecord] = {}
        self._published: dict[tuple[str, str], TargetStatus] = {}

    def load(self) -> list[TargetRecord]:
        """Read every persisted target (at start-up); a file that is not one is moved aside."""
        for cap in sorted(self.root.iterdir()):
            if not cap.is_dir() or not CAPTURE_ID_RE.fullmatch(cap.name):
                continue
            for f in sorted(cap.glob("*.json")):
                rec = load_or_move_aside(f, lambda doc, f=f: _parse_record(doc, f.parent.name, f.stem),
                                         component="agent", limit=limits.STATE_FILE, context={"capture_id": cap.name})
                if rec is not None:
                    self._records[rec.key] = rec
                    self._published[rec.key] = copy.deepcopy(rec.status)
        return list(self._records.values())

    def get(self, capture_id: str, target_id: str) -> TargetRecord | None:
        """The working record (what the pipeline acts on), which may be ahead of the disk."""
        return self._records.get((capture_id, target_id))

    def status(self, capture_id: str, target_id: str) -> TargetStatus | None:
        """The status last written to disk: the only one anybody outside the agent sees."""
        return self._published.get((capture_id, target_id))

    def statuses(self, capture_id: str) -> list[TargetStatus]:
        return [s for (c, t), s in sorted(self._published.items()) if c == capture_id]

    def capture(self, capture_id: str) -> list[TargetRecord]:
        return sorted((r for (c, _), r in self._records.items() if c == capture_id), key=lambda r: r.target_id)

    def all(self) -> list[TargetRecord]:
        return list(self._records.values())

    def forget(self, capture_id: str) -> None:
        """Drop a capture's facts from memory and disk (retention)."""
        for key in [k for k in self._records if k[0] == capture_id]:
            del self._records[key]
            self._published.pop(key, None)
        shutil.rmtree(self.root / capture_id, ignore_errors=True)

    def put(self, rec: TargetRecord) -> None:
        """Persist `rec` atomically, then publish its status; StoreWriteFailed when the disk refused."""
        if not (CAPTURE_ID_RE.fullmatch(rec.capture_id) and TARGET_ID_RE.fullmatch(rec.target_id)):
            raise ValueError(f"unsafe ids {rec.key!r}")
        final = self._published.get(rec.key)
        if final is not None and final.terminal and (final.state, final.reason) != (rec.status.state, rec.status.reason):
            raise FinalStatusConflict(f"{rec.key!r} already ended {final.state.value}"
                                      f"{f'({final.reason.value})' if final.reason else ''}; "
                                      f"refusing {rec.status.state.value}")
        directory = self.root / rec.capture_id
        path = directory / f"{rec.target_id}.json"
        tmp = directory / f".{rec.target_id}.json.tmp"
        data = json.dumps(rec.to_dict(), sort_keys=True).encode()
        try:
            directory.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(directory)
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise StoreWriteFailed(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
        self._records[rec.key] = rec
        self._published[rec.key] = copy.deepcopy(rec.status)


def _parse_record(doc: object, capture_id: str, target_id: str) -> TargetRecord:
    """A target record that belongs where it was found; TypeError/ValueError otherwise."""
    if not isinstance(doc, dict) or not isinstance(doc.get("status"), dict) or not isinstance(doc.get("dispatch"), dict):
        raise TypeError("not an object with 'status' and 'dispatch' objects")
    rec = TargetRecord.from_dict(doc)
    if rec.key != (capture_id, target_id) or rec.status.target_id != target_id:
        raise ValueError(f"holds {rec.key!r}, not ({capture_id!r}, {target_id!r})")
    rec.spec  # noqa: B018 - the dispatch must parse, or the pipeline would fail on it later
    return rec


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
