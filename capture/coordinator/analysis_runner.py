"""Run `gpulens analyze MANIFEST_URI` as a child process once a capture has converged.

A separate process keeps HTA and pandas (and their memory) out of the coordinator; one analysis
runs at a time per coordinator. The outcome is a visible state, never a reason for the capture
to fail: `done` with the report URI, `failed` with a reason, or `skipped` (nothing archived).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from gpulens.ground.logs import get_logger

__all__ = ["AnalysisRunner"]

log = get_logger("coordinator")

_MEANING = {2: "refused the manifest", 3: "nothing could be analysed"}


@dataclass
class AnalysisRunner:
    s3_endpoint: str | None = None
    timeout_s: float = 1800.0
    command: tuple[str, ...] = (sys.executable, "-m", "gpulens.cli", "analyze")

    def __post_init__(self) -> None:
        self._one_at_a_time = asyncio.Semaphore(1)

    async def run(self, manifest_uri: str, capture_id: str) -> dict[str, Any]:
        argv = [*self.command, manifest_uri]
        if self.s3_endpoint:
            argv += ["--s3-endpoint", self.s3_endpoint]
        async with self._one_at_a_time:
            log.info("analysis.started", capture_id=capture_id, manifest_uri=manifest_uri)
            try:
                proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                            stderr=asyncio.subprocess.PIPE, start_new_session=True)
            except OSError as exc:
                return {"state": "failed", "reason": f"could not start gpulens analyze: {exc}"}
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except asyncio.TimeoutError:
                self._kill(proc)
                await proc.wait()
                return {"state": "failed", "reason": f"gpulens analyze ran longer than {self.timeout_s:.0f} s"}
            except asyncio.CancelledError:
                self._kill(proc)
                await proc.wait()
                raise
        lines = out.decode(errors="replace").strip().splitlines()
        report = lines[-1].strip() if lines else None
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        if proc.returncode in (0, 3) and report:
            result = {"state": "done", "report_uri": report, "exit_code": proc.returncode}
            if proc.returncode == 3:
                result["reason"] = _MEANING[3]
        else:
            meaning = _MEANING.get(proc.returncode, f"exit code {proc.returncode}")
            result = {"state": "failed", "reason": f"gpulens analyze {meaning}: {tail[0][-300:]}".rstrip(": "),
                      "exit_code": proc.returncode}
        log.info("analysis.finished", capture_id=capture_id, state=result["state"], exit_code=proc.returncode)
        return result

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
