"""Capture after capture on a real 4-rank PyTorch job over two node agents (issue 34's soak).

Two nodes, each a network namespace of its own (tests/netnodes.py: its own loopback, address and
abstract Unix socket namespace, one L2 segment between them), with its own hostPath folders
(registry, traces, state) and its own `gpulens agent` (builtin endpoint at the abstract
`@dynolog`, or a dynolog double per node that the agent talks to over RPC on the node's loopback);
two ranks of one gloo job on each (plain_trainer.py: a plain loop, no torch.profiler), armed by
the real hook, whose collective crosses the segment as it would cross a cluster's network. One
in-process coordinator on this host fans out to both agents at the nodes' addresses. Needs root.

`Soak.run(n)` starts n captures back to back, alternating iteration captures (3 steps, one start
iteration chosen by the coordinator) and 500 ms wall-clock windows; every third one is followed
at once by a second request while it runs, which the coordinator must refuse (409 in HTTP:
`CaptureBusy` naming the holder). Used by tests/coordinator/test_soak_real.py (a short run in the
suite) and bench/soak_captures.py (50 captures, recorded in BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from gpulens.capture.coordinator import DeadlinePolicy, FanoutSettings
from gpulens.capture.coordinator.service import CaptureBusy
from gpulens.capture.models import CaptureReason, CaptureRequest
from gpulens.hooks import hook_path
from tests.coordinator.conftest import AGENT_TOKEN, make_coordinator
from tests.coordinator.servers import GpulensProcess
from tests.netnodes import NetNode, NodeNetwork

REPO = Path(__file__).resolve().parents[2]
TRAINER = str(REPO / "tests" / "agent" / "plain_trainer.py")
POLICY = DeadlinePolicy(start_delay_s=12.0, dispatch_s=3.0, write_s=4.0, write_per_window=0.5, archive_s=10.0,
                        report_s=4.0)
#: reasons a target may end with whose evidence the agent states (a rank past the start, a process
#: that still held an earlier config): anything else is a false or unexplained failure
PROVEN = {"missed_start", "busy_timeout"}

#: Fixed ports inside each node's own network namespace, below its ephemeral range (32768-60999):
#: a port the host found free (tests.conftest.free_port) was taken in the node by then, once, by an
#: ephemeral socket of the ranks started before the agent (CI-way run: "address already in use").
AGENT_PORT = 9451       # the chart's agent port
MASTER_PORT = 29500     # torch's default rendezvous port


class SoakNode:
    def __init__(self, name: str, base: Path, archive: Path, net: NetNode):
        self.name, self.base, self.archive, self.net = name, base / name, archive, net
        for d in ("reg", "traces", "state"):
            (self.base / d).mkdir(parents=True)
            os.chmod(self.base / d, 0o1777)
        self.port = AGENT_PORT
        self.url = f"http://{net.ip}:{self.port}"
        self.trainers: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.agent: GpulensProcess | None = None
        self.dynolog: subprocess.Popen | None = None

    def start_rank(self, rank: int, local_rank: int, world: int, master: str, master_port: int,
                   stop_file: Path, step_s: float = 0.02) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
        env.update(PYTHONPATH=str(hook_path()), OMP_NUM_THREADS="1", GPULENS_JOB_ID="soak", GPULENS_ATTEMPT="0",
                   GPULENS_NAMESPACE="ml", GPULENS_POD_NAME=f"soak-{self.name}", GPULENS_POD_UID=f"uid-{self.name}",
                   GPULENS_NODE_NAME=self.name, GPULENS_CONTAINER_NAME="trainer",
                   GPULENS_REGISTRY_DIR=str(self.base / "reg"), GPULENS_TRACE_DIR=str(self.base / "traces"),
                   RANK=str(rank), LOCAL_RANK=str(local_rank), GROUP_RANK=self.name[-1], WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR=master, MASTER_PORT=str(master_port),
                   GLOO_SOCKET_IFNAME=self.net.ifname)
        log = self.base / f"trainer-{rank}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.trainers.append(subprocess.Popen(self.net.cmd([sys.executable, TRAINER, str(stop_file), "3000", "-1", "0",
                                                                             str(step_s)]),
                                                  env=env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True))

    async def start_agent(self, token_file: Path, trigger: str) -> None:
        args = ["agent", "--listen", f"{self.net.ip}:{self.port}", "--node", self.name,
                "--registry-dir", str(self.base / "reg"), "--trace-dir", str(self.base / "traces"),
                "--state-dir", str(self.base / "state"), "--archive-root", f"file://{self.archive}",
                "--token-file", str(token_file)]
        if trigger == "dynolog":            # the node's dynolog: its loopback, its abstract @dynolog
            # its stdout (the ready line, then one line per config Kineto fetched) goes to a file: a
            # pipe nobody reads would stop the double once full, and the lines explain a failure
            with open(self.base / "dynolog.out", "wb") as out:
                self.dynolog = subprocess.Popen(
                    self.net.cmd([sys.executable, "-m", "tests.doubles.dynolog_double", "--port", "0"]), cwd=REPO,
                    stdout=out, stderr=open(self.base / "dynolog.log", "wb"), start_new_session=True)
            end = time.time() + 60
            while not (lines := self.dynolog_lines()) and self.dynolog.poll() is None and time.time() < end:
                await asyncio.sleep(0.1)
            ready = lines[0] if lines else {}
            if not ready.get("ready"):
                raise AssertionError(f"the dynolog double on {self.name} did not start: "
                                     f"{(self.base / 'dynolog.log').read_text()[-2000:]}")
            args += ["--trigger", "dynolog", "--dynolog-addr", f"127.0.0.1:{ready['rpc_port']}"]
        else:
            args += ["--trigger", "builtin"]
        self.agent = await GpulensProcess(args, self.base / "agent.log", prefix=self.net.cmd([])).start()
        await self.agent.wait_ready(self.url)

    def dynolog_lines(self) -> list[dict]:
        path = self.base / "dynolog.out"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]

    def explain(self, target_detail: str) -> str:
        """What the node saw of one failed target: when (if ever) its trainer's Kineto fetched the
        config from the dynolog double, whether a trace came later, and the trainer's own lines."""
        parts = []
        if self.dynolog is not None:
            fetched = [d["delivered"] for d in self.dynolog_lines() if "delivered" in d
                       and d["delivered"].get("log_file") and _stem(d["delivered"]["log_file"]) in target_detail]
            parts.append("Kineto fetched it at " + ", ".join(time.strftime("%H:%M:%S", time.gmtime(d["at"]))
                                                            + f".{int(d['at'] * 1000) % 1000:03d}Z" for d in fetched)
                         if fetched else "Kineto never fetched it from the double")
        late = [str(p.relative_to(self.archive)) for p in self.archive.rglob("*late*")] if self.archive.exists() else []
        parts.append(f"late traces archived: {late}")
        for log in self.logs:
            own = [line for line in log.read_text(errors="replace").splitlines()
                   if line and not line.startswith(("ready ", "[gpulens"))]
            parts.append(f"{log.name}: {own[-8:]}")
        return f"{self.name}: " + "; ".join(parts)

    def kineto_cancelled(self, target_detail: str) -> str | None:
        """The trainer's own log line where Kineto cancelled this target's time-based config (same
        pid, between queueing and the deadline), if there is one: a refusal with Kineto's evidence."""
        m = _QUEUED.search(target_detail)
        if m is not None:
            queued, pid, deadline = m.groups()
        elif (r := _REFUSED.search(target_detail)) is not None:
            pid, queued, deadline = r.groups()
        else:
            return None
        for log in self.logs:
            for line in log.read_text(errors="replace").splitlines():
                c = KINETO_CANCELLED.match(line)
                if c and c.group(2) == pid and queued <= c.group(1)[-8:] <= deadline:
                    return line
        return None

    def records(self) -> list[Path]:
        return sorted((self.base / "reg").glob("*.json"))

    def loose_traces(self) -> list[str]:
        """Trace files still on the node (finished ones; `.tmp` is Kineto at work)."""
        return sorted(str(p.relative_to(self.base)) for p in (self.base / "traces").rglob("*.json"))

    def failed_to_open(self) -> list[str]:
        return [line for log in self.logs for line in log.read_text(errors="replace").splitlines()
                if "Failed to open" in line]

    async def stop(self) -> None:
        if self.agent:
            await self.agent.stop()
        if self.dynolog is not None and self.dynolog.poll() is None:
            self.dynolog.terminate()
            await asyncio.to_thread(self.dynolog.wait)
        for t in self.trainers:
            if t.poll() is None:
                try:
                    await asyncio.to_thread(t.wait, 20)
                except subprocess.TimeoutExpired:
                    os.killpg(t.pid, signal.SIGKILL)
                    t.wait()


def _stem(log_file: str) -> str:
    """The capture folder and file stem of a config's log file, as the trace Kineto writes keeps
    them (it inserts _<pid>; the folder is seen from the trainer's side)."""
    return "/".join(log_file.rpartition(".json")[0].split("/")[-2:])


#: Kineto's own cancellation of a time-based config (dynolog-kineto-protocol.md 4.4): its profiler
#: thread, ticking every second, must activate the request within one tick of parse + 1 s; a tick
#: that wakes late (a loaded machine) cancels it, and Kineto writes no trace
KINETO_CANCELLED = re.compile(r"^\w+:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (\d+):\d+ \S+\] Not starting tracing - "
                              r"(insufficient time for warmup|start timestamp is in the past)")
_QUEUED = re.compile(r"queued at (\d\d:\d\d:\d\d)Z, but no \S+_(\d+)\.json by the deadline (\d\d:\d\d:\d\d)Z")
#: the builtin endpoint's own report of it (issue 47: `kineto_refused`, within two polls)
_REFUSED = re.compile(r"Kineto in pid (\d+) fetched the config at (\d\d:\d\d:\d\d)Z and (?:did not run it|dropped it): "
                      r"it was still idle \(accepting configs\) at (\d\d:\d\d:\d\d)Z")


@dataclass
class CaptureResult:
    capture_id: str
    kind: str                        # iterations | window
    seconds: float
    phase: str
    targets: dict[str, dict]         # target id -> state, reason, detail, iterations
    start_iteration: int | None = None

    @property
    def fully_archived(self) -> bool:
        return self.phase == "converged" and all(t["state"] == "archived" for t in self.targets.values())

    def unproven(self) -> list[str]:
        return [f"{tid}: {t['reason']}: {t['detail']}" for tid, t in self.targets.items()
                if t["state"] != "archived" and t["reason"] not in PROVEN]

    def unaligned_windows(self, within_s: float = 5.0) -> str | None:
        """For a wall capture: an archived rank whose window did not start within one Kineto poll
        (`within_s`) of the instant the coordinator chose, or windows that do not all overlap."""
        if self.kind != "window":
            return None
        windows = {tid: t["window"] for tid, t in self.targets.items() if t["state"] == "archived"}
        if any(w is None or "chosen_start" not in w for w in windows.values()):
            return f"windows without the chosen start: {windows}"
        late = {tid: w["start_skew_s"] for tid, w in windows.items() if not 0 <= w["start_skew_s"] <= within_s}
        if late:
            return f"starts off the chosen instant by {late}"
        if windows and max(w["start"] for w in windows.values()) >= min(w["end"] for w in windows.values()):
            return f"windows do not overlap: {windows}"
        return None

    def misaligned(self) -> str | None:
        """For an iteration capture whose ranks were all archived: differing iterations, if any."""
        if self.kind != "iterations" or not self.fully_archived:
            return None
        spans = {tid: (t["iterations"] or {}).get("first") for tid, t in self.targets.items()}
        lasts = {tid: (t["iterations"] or {}).get("last") for tid, t in self.targets.items()}
        if len(set(spans.values())) != 1 or len(set(lasts.values())) != 1 or None in spans.values():
            return f"first {spans}, last {lasts}"
        return None


@dataclass
class Soak:
    trigger: str = "builtin"
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gl-soak-", dir="/var/tmp")))
    results: list[CaptureResult] = field(default_factory=list)
    refused_while_running: list[str] = field(default_factory=list)
    kineto_cancellations: list[str] = field(default_factory=list)   # filled by explain()
    keep: bool = False               # leave base (logs, registries, agent state) for reading afterwards
    step_s: float = 0.02             # the trainers' sleep per step: ~40 steps/s at 0.02, ~4 at 0.25

    async def __aenter__(self) -> "Soak":
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def _start(self) -> "Soak":
        self.nodes, self.net, self.http, self.coordinator = [], None, None, None
        self.archive, self.stop_file = self.base / "archive", self.base / "stop"
        token = self.base / "agent.token"
        token.write_text(AGENT_TOKEN)
        self.net = NodeNetwork(2)
        self.nodes = [SoakNode(f"node-{i + 1}", self.base, self.archive, n) for i, n in enumerate(self.net.nodes)]
        port = MASTER_PORT
        for i, node in enumerate(self.nodes):
            for local in (0, 1):
                node.start_rank(2 * i + local, local, 4, self.nodes[0].net.ip, port, self.stop_file, self.step_s)
        await asyncio.gather(*(n.start_agent(token, self.trigger) for n in self.nodes))
        end = time.time() + 240
        while not all(len(n.records()) == 2 and all(json.loads(r.read_text()).get("identity") == "process_group"
                                                      for r in n.records()) for n in self.nodes):
            if time.time() > end:
                raise AssertionError(f"the ranks did not register: {[n.records() for n in self.nodes]}")
            for n in self.nodes:
                for t, log in zip(n.trainers, n.logs):
                    if t.poll() is not None:
                        raise AssertionError(log.read_text()[-3000:])
            await asyncio.sleep(0.3)
        registry = self.base / "registry"                   # the coordinator's view of both nodes' records
        registry.mkdir()
        for n in self.nodes:
            for rec in n.records():
                (registry / rec.name).symlink_to(rec)
        self.http = aiohttp.ClientSession()
        self.coordinator = make_coordinator(self.base, self.http, {n.name: n.url for n in self.nodes},
                                            job="soak", registry=registry, policy=POLICY,
                                            fanout=FanoutSettings(poll_interval_s=0.5, max_poll_interval_s=2.0),
                                            archive_root=f"file://{self.archive}")
        end = time.time() + 120                             # a job that trains: every rank has stepped
        while True:
            views = [w for n in self.nodes for w in await self.coordinator.agents.workers(n.url)]
            if len(views) == 4 and all((w.get("steps") or {}).get("count", 0) >= 20 for w in views):
                return self
            if time.time() > end:
                raise AssertionError(f"the ranks did not step: {[w.get('steps') for w in views]}")
            await asyncio.sleep(0.5)

    async def __aexit__(self, *exc) -> None:
        if self.coordinator is not None:
            with contextlib.suppress(Exception):
                await self.coordinator.close()
        if self.http is not None:
            await self.http.close()
        self.stop_file.touch()
        await asyncio.gather(*(n.stop() for n in self.nodes), return_exceptions=True)
        if self.net is not None:
            self.net.close()
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)

    async def capture(self, i: int) -> CaptureResult:
        kind = "iterations" if i % 2 == 0 else "window"
        request = CaptureRequest(job_id="soak", duration_ms=30_000 if kind == "iterations" else 500,
                                 iterations=3 if kind == "iterations" else None, requested_by="soak",
                                 reason=CaptureReason(kind="manual", text=f"soak {i}"))
        began = time.time()
        record, _ = self.coordinator.start(request)
        if i % 3 == 2:   # a second request while this one runs: refused up front, naming the holder
            try:
                self.coordinator.start(CaptureRequest(job_id="soak", duration_ms=500, requested_by="soak",
                                                      reason=CaptureReason(kind="manual", text="overlap")))
            except CaptureBusy as busy:
                self.refused_while_running.append(str(busy))
            else:
                raise AssertionError("a capture was accepted while another of the same job ran")
        await self.coordinator.wait(record.capture_id)
        status = record.to_status(full=True)
        targets = {t["target_id"]: {"state": t["state"], "reason": t.get("reason"), "detail": t.get("detail"),
                                    "iterations": (t.get("artifact") or {}).get("iterations"),
                                    "window": (t.get("artifact") or {}).get("window")}
                   for t in status["targets"]}
        result = CaptureResult(record.capture_id, kind, time.time() - began, record.phase, targets,
                               record.start_iteration)
        self.results.append(result)
        return result

    def explain(self, results: list[CaptureResult]) -> list[str]:
        """Each unproven failure with what its node saw (SoakNode.explain), less those whose trainer
        logged Kineto cancelling the config (kept in `kineto_cancellations`)."""
        out = []
        for r in results:
            for line in r.unproven():
                # a line that names no node's folder (a rank no live worker holds: its process is
                # gone) is explained by every node's trainers: which one died, and how
                nodes = [n for n in self.nodes if f"/{n.name}/" in line] or self.nodes
                cancelled = next((c for n in nodes if (c := n.kineto_cancelled(line))), None)
                if cancelled and line.split(": ", 2)[1] in ("trace_timeout", "kineto_refused"):
                    self.kineto_cancellations.append(f"{r.capture_id} {line.split(':')[0]}: {cancelled}")
                    continue
                out.append(f"{r.capture_id} {line} || " + " | ".join(n.explain(line) for n in nodes))
        return out

    async def step_rate(self, over_s: float = 3.0) -> float:
        """The job's pace as the agents see it: the slowest rank's optimizer steps per second over
        `over_s` (the ranks step in lockstep, so all read about the same)."""
        async def counts() -> dict[str, int]:
            return {(n.name, w.get("global_rank"), w.get("host_pid")): (w.get("steps") or {}).get("count", 0)
                    for n in self.nodes for w in await self.coordinator.agents.workers(n.url)}
        before, t0 = await counts(), time.monotonic()
        await asyncio.sleep(over_s)
        after, dt = await counts(), time.monotonic() - t0
        return min((after[k] - before[k]) / dt for k in before if k in after)

    async def run(self, n: int) -> list[CaptureResult]:
        for i in range(n):
            await self.capture(i)
        return self.results

    async def settled(self, timeout: float = 120.0) -> list[str]:
        """Trace files left on the nodes once every lingering target had its chance (ideally none)."""
        end = time.time() + timeout
        while True:
            loose = [f"{n.name}/{p}" for n in self.nodes for p in n.loose_traces()]
            if not loose or time.time() > end:
                return loose
            await asyncio.sleep(0.5)
