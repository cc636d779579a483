"""Real PyTorch 2.13 (CPU) in Kineto daemon mode, armed by the gpulens hook, captured by the agent.

One torchrun with two workers serves the whole module (Kineto's fixed ~7 s warm-up per trace is
the cost that matters, so captures take both workers in one go and windows are short). The
pid-namespace test starts its own two trainers under `unshare --pid --fork`.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import AgentOptions, start_agent
from gpulens.capture.archive import RetryPolicy
from gpulens.hooks import hook_path
from tests.conftest import free_port, is_root
from tests.agent.probe_trainer import run_probe
from tests.doubles.dynolog_double import DynologDouble
from tests.conftest import requires

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "torch-test-token"
TRAINER = str(Path(__file__).with_name("trainer.py"))
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WINDOW_MS = 600


def trainer_env(base: Path, sock: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
    env.update(PYTHONPATH=str(hook_path()), GPULENS_REGISTRY_DIR=str(base / "reg"), GPULENS_SOCKET_DIR=sock,
               GPULENS_TRACE_DIR=str(base / "traces"), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


class Site:
    """One node's folders and trainer processes."""

    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="gl-torch-", dir="/var/tmp"))  # not /tmp: Kineto's default
        self.sock = tempfile.mkdtemp(prefix="gl-", dir="/tmp")
        for d in ("reg", "traces", "archive"):
            (self.base / d).mkdir()
            os.chmod(self.base / d, 0o1777)
        os.chmod(self.sock, 0o777)
        self.stop_file = self.base / "stop"
        self.procs: list[subprocess.Popen] = []
        self.states = 0

    def state_dir(self) -> Path:
        self.states += 1
        return self.base / f"state{self.states}"

    def records(self, job: str) -> list[dict]:
        out = []
        for f in (self.base / "reg").glob("*.json"):
            rec = json.loads(f.read_text())
            if rec["job_id"] == job:
                out.append(rec)
        return sorted(out, key=lambda r: r["global_rank"])

    def launchers(self) -> set[int]:
        """The pids of the torchrun launchers this site started (its other processes are trainers)."""
        return {p.pid for p in self.procs
                if any(str(a).endswith("torchrun") or a == "torch.distributed.run" for a in p.args)}

    def wait_records(self, job: str, n: int, timeout: float = 120) -> list[dict]:
        """At least `n` workers' records of `job`, once no launcher's record is left. A launcher
        imports torch and registers as a single process until its first worker registers and
        retires that record (the hook's rule); on a loaded machine torchrun takes seconds to start
        its workers, and a test that took the launcher's record traced the launcher: an empty trace
        (seen side by side, test_warmup_torch)."""
        end = time.time() + timeout
        while time.time() < end:
            recs = self.records(job)
            launchers = self.launchers()
            if len(recs) >= n and not any(r["pid"] in launchers for r in recs):
                return recs
            for p in self.procs:
                assert p.poll() is None, f"a trainer exited early (logs in {self.base})"
            time.sleep(0.2)
        raise AssertionError(f"{n} records for {job} did not appear")

    def options(self, **over) -> AgentOptions:
        kw = dict(host="127.0.0.1", port=0, node="node-t", registry_dir=self.base / "reg",
                  trace_dir=self.base / "traces", state_dir=self.state_dir(), archive_root=f"file://{self.base}/archive",
                  token=TOKEN, trigger="builtin", socket_dir=self.sock, retry_interval_s=0.5,
                  archive_policy=RetryPolicy(attempts=3, first_delay_s=0.2))
        kw.update(over)
        return AgentOptions(**kw)

    def close(self) -> None:
        self.stop_file.touch()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if os.environ.get("GPULENS_TEST_KEEP_SITES"):   # a post-mortem of a run: trainer logs, traces, state
            return
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.sock, ignore_errors=True)


@pytest.fixture(scope="module")
def site():
    s = Site()
    log = open(s.base / "trainer.log", "w")
    s.procs.append(subprocess.Popen(
        [TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", TRAINER, str(s.stop_file), "280"],
        env=trainer_env(s.base, s.sock, GPULENS_JOB_ID="e2e"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True))
    try:
        s.wait_records("e2e", 2)
        yield s
    finally:
        s.close()
        log.close()


def dispatch(site: Site, capture_id: str, rec: dict, *, activities=("cpu_op",), with_stack=True,
             deadline_s: float = 90) -> dict:
    return {"job_id": rec["job_id"], "attempt": 0, "rank": rec["global_rank"], "duration_ms": WINDOW_MS,
            "activities": list(activities), "options": {"with_stack": with_stack}, "deadline": time.time() + deadline_s,
            "archive_prefix": f"file://{site.base}/archive/default/{rec['job_id']}/0/{capture_id}"}


async def converge(client: AgentClient, capture_id: str, timeout: float = 120, seen: set | None = None) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        statuses = await client.status(capture_id) or []
        if seen is not None:
            seen.update((s.target_id, s.state.value) for s in statuses)
        if statuses and all(s.terminal for s in statuses):
            return {s.target_id: s for s in statuses}
        await asyncio.sleep(0.25)
    raise AssertionError(f"{capture_id} did not converge: {statuses}")


def archived_trace(status) -> dict:
    art = status.artifact
    data = Path(art.uri.removeprefix("file://")).read_bytes()
    assert hashlib.sha256(data).hexdigest() == art.sha256 and len(data) == art.size
    return json.loads(gzip.decompress(data) if art.uri.endswith(".gz") else data)


def categories(trace: dict) -> collections.Counter:
    return collections.Counter(e.get("cat") for e in trace["traceEvents"] if e.get("cat"))


async def capture_both(site: Site, running, capture_id: str, **kw) -> dict:
    recs = site.records("e2e")
    async with AgentClient(running.url, TOKEN) as client:
        for rec in recs:
            await client.dispatch(capture_id, f"rank-{rec['global_rank']}", dispatch(site, capture_id, rec, **kw))
        return await converge(client, capture_id)


async def test_builtin_backend_captures_both_workers_with_only_cpu_op(site):
    """Two armed workers, the builtin endpoint, one capture: two verified, archived, checksummed
    traces naming the right ranks and pids; cpu_op only although stacks are on."""
    running = await start_agent(site.options())
    try:
        done = await capture_both(site, running, "c-torch-builtin", activities=("cpu_op",), with_stack=True)
    finally:
        await running.stop()
    for rec in site.records("e2e"):
        st = done[f"rank-{rec['global_rank']}"]
        assert st.state.value == "archived", st
        assert (st.artifact.rank, st.artifact.pid, st.artifact.local_rank) == (rec["global_rank"], rec["pid"], rec["local_rank"])
        trace = archived_trace(st)
        cats = categories(trace)
        assert cats["cpu_op"] > 0
        assert cats["python_function"] == 0  # negative: Kineto's default set would have them (stacks are on)
        assert trace["trace_id"] == st.artifact.trace_id  # the id the agent put in the request
        assert {e["pid"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"} == {rec["pid"]}


async def test_dynolog_backend_captures_both_workers_through_the_double(site):
    """Same capture through stock dynolog's protocol (the double binds <socket dir>/dynolog and
    speaks RPC); this time python_function is requested, and present."""
    async with DynologDouble(socket_dir=site.sock) as double:
        running = await start_agent(site.options(trigger="dynolog", dynolog_addr=f"127.0.0.1:{double.port}"))
        try:
            done = await capture_both(site, running, "c-torch-dynolog", activities=("cpu_op", "python_function"),
                                      with_stack=True)
        finally:
            await running.stop()
    recs = site.records("e2e")
    for rec in recs:
        st = done[f"rank-{rec['global_rank']}"]
        assert st.state.value == "archived", st
        assert (st.artifact.rank, st.artifact.pid) == (rec["global_rank"], rec["pid"])
        cats = categories(archived_trace(st))
        assert cats["cpu_op"] > 0 and cats["python_function"] > 0
    requests = [r for r in double.rpc_requests if r["fn"] == "setKinetOnDemandRequest"]
    assert {(r["job_id"], tuple(r["pids"])) for r in requests} == {(rec["kineto_job_id"], (rec["pid"],)) for rec in recs}
    assert {d.pid for d in double.deliveries} == {rec["pid"] for rec in recs}


async def test_a_capture_while_another_traces_gets_its_own_file_and_an_explicit_outcome(site):
    """Busy: B is dispatched while A traces, C while B still waits in the slot. Nothing is
    overwritten, nothing silently lost: every capture ends archived in its own file or failed with
    a reason, and C is seen waiting for the slot first."""
    rec = site.records("e2e")[0]
    running = await start_agent(site.options())
    seen: set = set()
    try:
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-busy-aaaaaa", "rank-0", dispatch(site, "c-busy-aaaaaa", rec))
            while "Kineto fetched" not in ((await client.status("c-busy-aaaaaa"))[0].detail or ""):
                await asyncio.sleep(0.1)  # A is in Kineto's hands: warming up / tracing
            await client.dispatch("c-busy-bbbbbb", "rank-0", dispatch(site, "c-busy-bbbbbb", rec))
            while (await client.status("c-busy-bbbbbb"))[0].state.value != "queued_by_dynolog":
                await asyncio.sleep(0.1)
            await client.dispatch("c-busy-cccccc", "rank-0", dispatch(site, "c-busy-cccccc", rec, deadline_s=40))
            while True:  # B sits unfetched in the slot while A traces: C must wait for it
                c_now = (await client.status("c-busy-cccccc"))[0]
                seen.add((c_now.target_id, c_now.state.value))
                if c_now.terminal or c_now.state.value not in ("pending", "dispatched"):
                    break
                await asyncio.sleep(0.05)
            a = (await converge(client, "c-busy-aaaaaa"))["rank-0"]
            b = (await converge(client, "c-busy-bbbbbb"))["rank-0"]
            c = (await converge(client, "c-busy-cccccc", seen=seen))["rank-0"]
    finally:
        await running.stop()
    assert a.state.value == "archived" and b.state.value == "archived", (a, b)
    ta, tb = archived_trace(a), archived_trace(b)
    assert a.artifact.uri != b.artifact.uri and a.artifact.sha256 != b.artifact.sha256
    assert ta["trace_id"] != tb["trace_id"]
    assert min(e["ts"] for e in tb["traceEvents"] if e.get("ph") == "X") > \
        max(e["ts"] for e in ta["traceEvents"] if e.get("ph") == "X")  # B ran after A, not instead of it
    assert ("rank-0", "waiting_for_slot") in seen
    assert (c.state.value == "archived" and c.artifact.sha256 not in (a.artifact.sha256, b.artifact.sha256)) \
        or (c.state.value == "failed" and c.reason.value in ("busy_timeout", "trace_timeout", "kineto_refused")), c
    # kineto_refused: on a starved machine Kineto may take C's config too late for its warm-up and
    # drop it ("start timestamp is in the past"); the agent reads that off its polls (kineto_watch)


async def test_agent_killed_mid_capture_resumes_from_its_state(site):
    """`gpulens agent` is SIGKILLed while the targets are queued; a new one on the same state dir
    finishes them. Nothing was lost, the entries are served again."""
    token_file = site.base / "token"
    token_file.write_text(TOKEN)
    state = site.state_dir()
    port = free_port()
    args = [str(Path(sys.executable).parent / "gpulens"), "agent", "--listen", f"127.0.0.1:{port}", "--node", "node-t",
            "--registry-dir", str(site.base / "reg"), "--trace-dir", str(site.base / "traces"), "--state-dir", str(state),
            "--archive-root", f"file://{site.base}/archive", "--trigger", "builtin", "--socket-dir", site.sock,
            "--token-file", str(token_file)]

    def start() -> subprocess.Popen:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(site.base / "agent.log", "a"),
                                start_new_session=True)

    async def ready(client: AgentClient) -> None:
        for _ in range(200):
            if await client.healthy():
                return
            await asyncio.sleep(0.1)
        raise AssertionError((site.base / "agent.log").read_text()[-2000:])

    agent = start()
    try:
        async with AgentClient(f"http://127.0.0.1:{port}", TOKEN) as client:
            await ready(client)
            for rec in site.records("e2e"):
                await client.dispatch("c-torch-restart", f"rank-{rec['global_rank']}",
                                      dispatch(site, "c-torch-restart", rec))
            while not all(s.state.value == "queued_by_dynolog" for s in await client.status("c-torch-restart")):
                await asyncio.sleep(0.1)
            agent.kill()
            agent.wait()
            agent = start()
            await ready(client)
            done = await converge(client, "c-torch-restart")
    finally:
        agent.terminate()
        agent.wait(20)
    for rec in site.records("e2e"):
        st = done[f"rank-{rec['global_rank']}"]
        assert st.state.value == "archived" and st.artifact.pid == rec["pid"], (st.reason, st.detail)
        archived_trace(st)


@pytest.mark.root
@requires(None if is_root() and shutil.which("unshare") else "needs root and unshare")
async def test_two_pid_namespaces_with_the_same_pid_only_the_requested_one_is_traced(site):
    """Two pods on one node, each trainer is pid 1 in its own pid namespace and tells Kineto (and
    so the endpoint) only "pid 1". The per-pod Kineto job id the hook sets keeps them apart."""
    logs = []
    trainers = []
    for pod, rank in (("pod-a", 0), ("pod-b", 1)):
        env = trainer_env(site.base, site.sock, GPULENS_JOB_ID="nsjob", GPULENS_POD_NAME=pod, GPULENS_POD_UID=f"uid-{pod}",
                          RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
        log = open(site.base / f"{pod}.log", "w")
        logs.append(log)
        trainers.append(subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                          sys.executable, TRAINER, str(site.base / "stop-ns"), "200"],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    running = None
    try:
        recs = site.wait_records("nsjob", 2)
        assert [r["pid"] for r in recs] == [1, 1] and recs[0]["pid_namespace"] != recs[1]["pid_namespace"]
        assert recs[0]["kineto_job_id"] != recs[1]["kineto_job_id"]
        running = await start_agent(site.options())
        delivered = []
        forward = running.endpoint.on_delivered
        running.endpoint.on_delivered = lambda d: (delivered.append(d), forward(d))
        async with AgentClient(running.url, TOKEN) as client:
            workers = {w.record.pod: w for w in await client.workers() if w.record.job_id == "nsjob"}
            assert workers["pod-a"].alive and workers["pod-b"].alive
            assert workers["pod-a"].host_pid != workers["pod-b"].host_pid  # told apart through NSpid
            await client.dispatch("c-torch-pidns", "rank-0", dispatch(site, "c-torch-pidns", recs[0]))
            st = (await converge(client, "c-torch-pidns"))["rank-0"]
        assert st.state.value == "archived" and st.artifact.pid == 1 and st.artifact.pod == "pod-a", st
        trace = archived_trace(st)
        assert trace["trace_id"] == st.artifact.trace_id
        # pod-b, also "pid 1" and polling the same endpoint, was never handed a config
        assert [(d.job_id, d.pid) for d in delivered] == [(recs[0]["kineto_job_id"], 1)]
        assert any(p.job_id == recs[1]["kineto_job_id"] and p.pids == (1,) for p in running.endpoint.processes())
    finally:
        if running is not None:
            await running.stop()
        (site.base / "stop-ns").touch()
        for p in trainers:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()


@pytest.mark.root
@requires(None if is_root() and shutil.which("unshare") else "needs root and unshare --net")
def test_builtin_endpoint_on_the_abstract_socket_with_real_kineto(tmp_path):
    """Without KINETO_IPC_SOCKET_DIR Kineto polls the abstract `@dynolog\\0` (trailing NUL). In a
    private network namespace, the builtin endpoint answers it and a real trace comes back."""
    result = run_probe("abstract_probe.py", 150)
    assert result["address"] == "@dynolog\\0"
    assert result["outcome"] == "queued_by_dynolog" and result["delivered"] == [result["pid"]]
    assert result["trace_id"] == "31337" and result["cats"] == ["Trace", "cpu_op"]
