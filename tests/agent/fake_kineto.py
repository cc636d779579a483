"""A stand-in for one Kineto-armed trainer process, for fast agent tests (the slow tests run the
real thing, torch 2.13 CPU).

It follows what Kineto does on the wire and on disk (dynolog-kineto-protocol.md 3.4, 4.1, 4.7 and
what torch 2.13 showed): it polls `<socket dir>/dynolog` with `req` datagrams carrying its job id and
[pid, ancestors], with the activities bit (2) set only while it is not tracing; it parses the
config it receives line by line (KEY=VALUE), inserts `_<pid>` before `.json` in
ACTIVITIES_LOG_FILE, writes the trace to `<final>.tmp` and renames it over `<final>`. The trace has
Kineto's top-level keys, REQUEST_TRACE_ID as `trace_id`, and the requested activity types
(python_function only with PROFILE_WITH_STACK). `mode` makes it misbehave on purpose:
`truncate` (a torn write renamed into place), `ignore_types` (Kineto's default set instead of
ACTIVITY_TYPES), `refuse` (fetches the config, then drops it as Kineto does on "insufficient time
for warmup": it never turns busy, keeps polling idle, writes no trace, the reason only in its own
log), `no_file` (traces, busy polls and all, then goes idle without writing a file, as Kineto does
when its log file cannot be opened or a torch.profiler session cancels the trace), `between_polls`
(an iteration trace of a few fast steps, which real Kineto starts and finishes between two of its
5 s polls: such a trace runs inside the poll loop, so no poll ever says busy; time-based ones run
as usual), `no_rename` (writes its `.tmp`, then goes idle without renaming it: Kineto logs a failed
rename and leaves the `.tmp` behind).
`start_gate`: an Event the trace waits for before it opens its file, as a rank whose
iteration-aligned start comes a round-up later than another rank's does.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from gpulens.capture.dynolog import kineto_trace_path
from tests.agent.conftest import KinetoPoller, kineto_like_trace


class FakeKineto(threading.Thread):
    def __init__(self, socket_dir: str, job: int, pid: int, *, poll_s: float = 0.1, mode: str = "honest",
                 trace_delay_s: float = 0.2, path_map: tuple[str, str] | None = None,
                 start_gate: threading.Event | None = None, profiler_span: bool = False):
        super().__init__(daemon=True)
        self.poller = KinetoPoller(socket_dir, job, [pid, 1])
        self.pid, self.poll_s, self.mode, self.trace_delay_s = pid, poll_s, mode, trace_delay_s
        self.path_map = path_map
        self.start_gate = start_gate
        self.profiler_span = profiler_span        # write Kineto's "PyTorch Profiler (0)" collection span
        self.failed: list[BaseException] = []   # what the trace thread raised (e.g. its folder was gone)
        self.configs: list[dict[str, str]] = []
        self.written: list[Path] = []
        self.tracing = False
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.poller.close()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                text = self.poller.poll(config_type=0 if self.tracing else 2, timeout=0.5)
            except OSError:  # no endpoint bound (yet, or any more): Kineto logs and polls again
                text = None
            if text and text.strip():
                cfg = {}
                for line in text.splitlines():
                    if line.strip():
                        key, value = (part.strip() for part in line.split("="))
                        cfg[key] = value
                self.configs.append(cfg)
                if self.mode == "between_polls" and int(cfg.get("ACTIVITIES_ITERATIONS", "0")) > 0:
                    self._trace(cfg)          # no poll while it runs: never seen busy
                elif self.mode != "refuse":    # a refused config never activates the profiler
                    self.tracing = True
                    threading.Thread(target=self._trace, args=(cfg,), daemon=True).start()
            self._halt.wait(self.poll_s)

    def _trace(self, cfg: dict[str, str]) -> None:
        try:
            time.sleep(self.trace_delay_s)
            if self.start_gate is not None and not self.start_gate.wait(60):
                return
            if self.mode == "no_file":
                time.sleep(int(cfg.get("ACTIVITIES_DURATION_MSECS", "500")) / 1000)
                return
            start = time.time()
            duration = int(cfg.get("ACTIVITIES_DURATION_MSECS", "500")) / 1000
            types = [t for t in cfg.get("ACTIVITY_TYPES", "").split(",") if t]
            stack = cfg.get("PROFILE_WITH_STACK") == "true"
            if self.mode == "ignore_types" or not types:
                cats = ("cpu_op", "python_function") if stack else ("cpu_op",)
            else:
                cats = tuple(t for t in types if t == "cpu_op" or (t == "python_function" and stack))
            final = Path(kineto_trace_path(cfg["ACTIVITIES_LOG_FILE"], self.pid))
            if self.path_map:
                final = Path(str(final).replace(*self.path_map, 1))
            tmp = final.with_name(final.name + ".tmp")
            kineto_like_trace(tmp, pid=self.pid, start=start, duration_s=duration, cats=cats,
                              trace_id=cfg.get("REQUEST_TRACE_ID"), extra_top=None, profiler_span=self.profiler_span)
            text = tmp.read_text().replace(str(tmp), str(cfg["ACTIVITIES_LOG_FILE"]).replace(".json", f"_{self.pid}.json", 1))
            if self.mode == "truncate":
                text = text[: len(text) // 2]
            tmp.write_text(text)
            if self.mode == "no_rename":
                return
            if final.exists():
                os.unlink(final)  # Kineto removes an existing final file before its rename
            os.rename(tmp, final)
            self.written.append(final)
        except OSError as exc:   # Kineto logs "Failed to open" and writes nothing; so does this
            self.failed.append(exc)
        finally:
            self.tracing = False
