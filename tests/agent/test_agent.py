"""The agent as a whole (in-process, real HTTP, real IPC socket, real files), driven by a Kineto
stand-in: every target outcome, the API's refusals, idempotency, cancel, restart, archive faults.
Real PyTorch runs through the same paths in test_torch.py."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from gpulens.capture.agent.client import AgentClient, AgentError
from gpulens.capture.agent.runtime import AgentOptions, start_agent
from gpulens.capture.archive import RetryPolicy
from gpulens.capture.models import Artifact
from tests.agent.fake_kineto import FakeKineto
from tests.s3server import CREDS, SwitchableProxy, start_moto, stop_process
from tests.conftest import free_port

TOKEN = "s3cret-token"
JOB, KJOB = "train", 4711


class Node:
    """Folders of one node, the worker processes (real, sleeping) and their registration records."""

    def __init__(self, base: Path, sock_dir: str):
        self.base, self.sock_dir = base, sock_dir
        for d in ("reg", "traces", "state", "archive"):
            (base / d).mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.kinetos: list[FakeKineto] = []

    @property
    def archive_root(self) -> str:
        return f"file://{self.base}/archive"

    def prefix(self, capture_id: str) -> str:
        return f"{self.archive_root}/ns/{JOB}/0/{capture_id}"

    def worker(self, rank: int, *, kineto: str | None = "honest", argv: list[str] | None = None, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv or [sys.executable, "-c", "import time; time.sleep(120)"])
        self.procs.append(p)
        rec = {"schema_version": 1, "job_id": JOB, "attempt": 0, "namespace": "ns", "pod": "pod-a", "pod_uid": "uid-a",
               "container": "c", "node": "node-1", "global_rank": rank, "local_rank": rank, "world_size": 2,
               "local_world_size": 2, "pid": p.pid, "host_pid": p.pid, "pid_namespace": os.readlink("/proc/self/ns/pid"),
               "kineto_job_id": KJOB, "start_time": time.time() + 1, "trace_dir": str(self.base / "traces"),
               "socket_dir": self.sock_dir}
        (self.base / "reg" / f"r{rank}.json").write_text(json.dumps(rec))
        if kineto:
            k = FakeKineto(self.sock_dir, KJOB, p.pid, mode=kineto, **kw)
            k.start()
            self.kinetos.append(k)
        return p

    def options(self, **over) -> AgentOptions:
        kw = dict(host="127.0.0.1", port=0, node="node-1", registry_dir=self.base / "reg",
                  trace_dir=self.base / "traces", state_dir=self.base / "state", archive_root=self.archive_root,
                  token=TOKEN, trigger="builtin", socket_dir=self.sock_dir, retry_interval_s=0.2,
                  archive_policy=RetryPolicy(attempts=3, first_delay_s=0.1))
        kw.update(over)
        return AgentOptions(**kw)

    def close(self) -> None:
        for k in self.kinetos:
            k.stop()
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def node(tmp_path, sock_dir):
    n = Node(tmp_path, sock_dir)
    yield n
    n.close()


@pytest.fixture
async def agent(node):
    running = await start_agent(node.options())
    yield running
    await running.stop()


def dispatch(node: Node, capture_id: str, rank: int, **over) -> dict:
    body = {"job_id": JOB, "attempt": 0, "rank": rank, "duration_ms": 300, "activities": ["cpu_op"],
            "deadline": time.time() + 30, "archive_prefix": node.prefix(capture_id)}
    body.update(over)
    return body


async def converge(client: AgentClient, capture_id: str, timeout: float = 60) -> dict[str, object]:
    end = time.time() + timeout
    while time.time() < end:
        statuses = await client.status(capture_id)
        if statuses and all(s.terminal for s in statuses):
            return {s.target_id: s for s in statuses}
        await asyncio.sleep(0.1)
    raise AssertionError(f"capture {capture_id} did not converge: {statuses}")


async def test_two_workers_end_verified_archived_and_checksummed(node, agent):
    procs = [node.worker(0), node.worker(1)]
    async with AgentClient(agent.url, TOKEN) as client:
        for rank in (0, 1):
            res = await client.dispatch("c-two-workers", f"rank-{rank}", dispatch(node, "c-two-workers", rank))
            assert res.created and res.status.state.value in ("pending", "dispatched")
        done = await converge(client, "c-two-workers")
    for rank, proc in enumerate(procs):
        st = done[f"rank-{rank}"]
        assert st.state.value == "archived", (st.reason, st.detail)
        art = st.artifact
        assert isinstance(art, Artifact) and art.rank == rank and art.pid == proc.pid and art.node == "node-1"
        data = Path(art.uri.removeprefix("file://")).read_bytes()
        import hashlib
        assert hashlib.sha256(data).hexdigest() == art.sha256 and len(data) == art.size  # the stored (gzip) bytes
        assert art.uri == f"{node.prefix('c-two-workers')}/traces/rank-{rank}.json.gz"
        raw = gzip.decompress(data)   # issue 27: the archive holds the gzip of Kineto's file, written while verifying
        assert json.loads(raw)["traceName"].endswith(f"rank-{rank}_{proc.pid}.json")
        assert art.sizes == {"budget": None, "estimate": None, "uncompressed": len(raw), "stored": len(data),
                             "encoding": "gzip", "gpu_buffer_mb": None, "stopped_early": None}
        assert art.trace_id == node.kinetos[rank].configs[0]["REQUEST_TRACE_ID"]  # the file answers our request
        assert not (node.base / "traces" / "c-two-workers" / f"rank-{rank}_{proc.pid}.json").exists()  # local copy gone
    # the Kineto stand-ins got exactly what the contract says: a per-(capture, target) name, cpu_op only
    cfg = node.kinetos[0].configs[0]
    assert cfg["ACTIVITIES_LOG_FILE"] == str(node.base / "traces" / "c-two-workers" / "rank-0.json")
    assert cfg["ACTIVITY_TYPES"] == "cpu_op"
    assert list((node.base / "state" / "staging").iterdir()) == []   # the staged copies went once archived


async def test_compress_level_0_archives_the_trace_as_it_is(node):
    """The format before issue 27 (and what analysis must still read): raw JSON, checksum of it."""
    running = await start_agent(node.options(compress_level=0))
    try:
        proc = node.worker(0)
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-raw-archive", "rank-0", dispatch(node, "c-raw-archive", 0))
            st = (await converge(client, "c-raw-archive"))["rank-0"]
    finally:
        await running.stop()
    assert st.state.value == "archived", st
    data = Path(st.artifact.uri.removeprefix("file://")).read_bytes()
    assert st.artifact.uri.endswith("/traces/rank-0.json") and data.startswith(b"{")
    assert st.artifact.sizes["encoding"] == "identity" and st.artifact.sizes["stored"] == len(data) == st.artifact.size
    assert json.loads(data)["traceName"].endswith(f"rank-0_{proc.pid}.json")


@pytest.mark.parametrize("mode, outcome", [("honest", "archived"), ("no_file", "failed")])
async def test_a_rank_starting_after_another_is_archived_still_finds_the_captures_folder(node, agent, mode, outcome):
    """Ranks that fetch an iteration-aligned config on either side of a round-up multiple start a
    round-up apart, and Kineto opens its file only then: rank 1 archived (its local copy gone) must
    leave the shared folder for rank 0, whose trace has not started yet. The folder goes with the
    last target, archived or not (`no_file`: rank 0 traces and writes nothing, trace_timeout)."""
    later = threading.Event()
    procs = [node.worker(0, kineto=mode, start_gate=later), node.worker(1)]
    folder = node.base / "traces" / "c-round-up-apart"
    deadline = time.time() + 16   # the trigger's last chance is 12 s before it; no_file waits it out
    async with AgentClient(agent.url, TOKEN) as client:
        for rank in (0, 1):
            await client.dispatch("c-round-up-apart", f"rank-{rank}",
                                  dispatch(node, "c-round-up-apart", rank, deadline=deadline))

        async def rank_1_dropped() -> None:
            while True:
                rank_1 = {s.target_id: s for s in await client.status("c-round-up-apart") or []}.get("rank-1")
                if rank_1 and rank_1.terminal:
                    assert rank_1.state.value == "archived", rank_1
                    if not (folder / f"rank-1_{procs[1].pid}.json").exists():
                        return
                await asyncio.sleep(0.05)
        await asyncio.wait_for(rank_1_dropped(), 15)
        # the archived copy and the folder go in one synchronous step, so this sees the decision
        assert folder.is_dir(), "rank 1's clean-up removed the folder rank 0 has yet to write into"
        rank_0 = {s.target_id: s for s in await client.status("c-round-up-apart")}["rank-0"]
        assert not rank_0.terminal, rank_0   # still waiting for its start, as Kineto's later rank is
        later.set()
        done = await converge(client, "c-round-up-apart")
    assert not node.kinetos[0].failed, node.kinetos[0].failed   # its folder was there when it started
    assert done["rank-0"].state.value == outcome, done["rank-0"]
    end = time.time() + 10   # the last target takes the folder with it, once no late trace can come
    while folder.exists():
        assert time.time() < end, sorted(p.name for p in folder.iterdir())
        await asyncio.sleep(0.05)


async def test_a_repeated_dispatch_is_a_no_op(node, agent):
    node.worker(0)
    async with AgentClient(agent.url, TOKEN) as client:
        body = dispatch(node, "c-repeat-0001", 0)
        first = await client.dispatch("c-repeat-0001", "rank-0", body)
        again = await client.dispatch("c-repeat-0001", "rank-0", body)
        assert first.created and not again.created
        await converge(client, "c-repeat-0001")
        late = await client.dispatch("c-repeat-0001", "rank-0", body)
        assert not late.created and late.status.state.value == "archived"
        await asyncio.sleep(0.5)
    assert len(node.kinetos[0].configs) == 1  # one trigger, one trace


async def test_truncated_trace_fails_verification_and_keeps_its_bytes(node, agent):
    p = node.worker(0, kineto="truncate")
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-truncated-01", "rank-0", dispatch(node, "c-truncated-01", 0))
        st = (await converge(client, "c-truncated-01"))["rank-0"]
    assert st.state.value == "failed" and st.reason.value == "verification_failed"
    assert "truncated" in st.detail
    kept = node.base / "traces" / "c-truncated-01" / f"rank-0_{p.pid}.json"
    assert kept.exists() and str(kept) in st.detail
    assert not list((node.base / "archive").rglob("*.json*"))  # nothing archived


async def test_kineto_ignoring_activity_types_fails_verification(node, agent):
    node.worker(0, kineto="ignore_types")
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-ignored-types", "rank-0",
                              dispatch(node, "c-ignored-types", 0, options={"with_stack": True}))
        st = (await converge(client, "c-ignored-types"))["rank-0"]
    assert st.reason.value == "verification_failed" and "python_function" in st.detail


async def test_unregistered_gone_and_unmatched_targets_fail_explicitly(node, agent):
    dead = node.worker(1, kineto=None)
    dead.kill()
    dead.wait()
    node.worker(2, kineto=None)  # registered and alive, but its Kineto never polls
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-failures-01", "rank-0", dispatch(node, "c-failures-01", 0))  # no record at all
        await client.dispatch("c-failures-01", "rank-1", dispatch(node, "c-failures-01", 1))
        await client.dispatch("c-failures-01", "rank-2",
                              dispatch(node, "c-failures-01", 2, duration_ms=100, deadline=time.time() + 13))
        done = await converge(client, "c-failures-01")
    assert done["rank-0"].reason.value == "not_registered"
    assert done["rank-1"].reason.value == "process_gone"
    assert done["rank-2"].reason.value == "not_matched" and str(KJOB) in done["rank-2"].detail


async def test_cancel_ends_unqueued_targets_only(node, agent):
    node.worker(0, kineto=None)  # never polls: stays not_matched
    node.worker(1)
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-cancel-0001", "rank-1", dispatch(node, "c-cancel-0001", 1))
        while (await client.status("c-cancel-0001"))[0].state.value not in ("queued_by_dynolog", "trace_observed",
                                                                            "verified", "archived"):
            await asyncio.sleep(0.05)
        await client.dispatch("c-cancel-0001", "rank-0", dispatch(node, "c-cancel-0001", 0))
        while (await client.status("c-cancel-0001"))[0].state.value != "not_matched":
            await asyncio.sleep(0.05)
        await client.cancel("c-cancel-0001")
        done = await converge(client, "c-cancel-0001")
    assert done["rank-0"].reason.value == "cancelled"
    assert done["rank-1"].state.value == "archived"  # already queued: it lands anyway (logical cancel)


async def test_dynolog_not_listening_is_a_clear_failure(node):
    node.worker(0, kineto=None)
    running = await start_agent(node.options(trigger="dynolog", dynolog_addr=f"127.0.0.1:{free_port()}",
                                             dynolog_timeout_s=1))
    try:
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-no-dynolog1", "rank-0", dispatch(node, "c-no-dynolog1", 0))
            st = (await converge(client, "c-no-dynolog1", timeout=20))["rank-0"]
        assert st.reason.value == "dynolog_unreachable" and "not listening" in st.detail
    finally:
        await running.stop()


async def test_the_dynolog_backend_through_the_double(node):
    from tests.doubles.dynolog_double import DynologDouble

    async with DynologDouble(socket_dir=node.sock_dir) as double:
        procs = [node.worker(0), node.worker(1)]
        running = await start_agent(node.options(trigger="auto", dynolog_addr=f"127.0.0.1:{double.port}"))
        try:
            assert running.backend == "dynolog" and running.endpoint is None
            async with AgentClient(running.url, TOKEN) as client:
                for rank in (0, 1):
                    await client.dispatch("c-via-dynolog", f"rank-{rank}", dispatch(node, "c-via-dynolog", rank))
                done = await converge(client, "c-via-dynolog")
        finally:
            await running.stop()
    for rank, proc in enumerate(procs):
        art = done[f"rank-{rank}"].artifact
        assert done[f"rank-{rank}"].state.value == "archived" and art.pid == proc.pid
        # dynolog chose the trace id; the agent learnt it from the file
        assert art.trace_id == node.kinetos[rank].configs[0]["REQUEST_TRACE_ID"]
    assert {d.pid for d in double.deliveries} == {p.pid for p in procs}
    assert all(r["job_id"] == KJOB for r in double.rpc_requests if r["fn"] == "setKinetOnDemandRequest")


async def test_restart_mid_capture_loses_nothing(node):
    node.worker(0)
    node.worker(1, kineto=None)  # will be "tracing" only after the restart
    running = await start_agent(node.options())
    async with AgentClient(running.url, TOKEN) as client:
        await client.dispatch("c-restart-001", "rank-0", dispatch(node, "c-restart-001", 0))
        await converge(client, "c-restart-001")
        await client.dispatch("c-restart-001", "rank-1", dispatch(node, "c-restart-001", 1, deadline=time.time() + 40))
        while (await client.status("c-restart-001"))[1].state.value != "not_matched":
            await asyncio.sleep(0.05)
    await running.stop()
    # rank 1's Kineto starts polling while the agent is down; a new agent on the same state dir
    k = FakeKineto(node.sock_dir, KJOB, node.procs[1].pid)
    k.start()
    node.kinetos.append(k)
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            first = {s.target_id: s for s in await client.status("c-restart-001")}
            assert first["rank-0"].state.value == "archived"  # the finished fact survived
            done = await converge(client, "c-restart-001")
        assert done["rank-1"].state.value == "archived" and done["rank-0"].artifact == first["rank-0"].artifact
    finally:
        await running.stop()


async def test_queued_but_unfetched_builtin_configs_are_queued_again_after_a_restart(node):
    p = node.worker(0, kineto=None)
    running = await start_agent(node.options())
    from tests.agent.conftest import KinetoPoller
    reg = KinetoPoller(node.sock_dir, KJOB, [p.pid, 1])
    try:
        await asyncio.to_thread(reg.poll, 0)  # registered, busy tracing: never fetches
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-requeue-001", "rank-0", dispatch(node, "c-requeue-001", 0))
            while (await client.status("c-requeue-001"))[0].state.value != "queued_by_dynolog":
                await asyncio.sleep(0.05)
        await running.stop()  # the pending slot dies with the process
    finally:
        reg.close()
    k = FakeKineto(node.sock_dir, KJOB, p.pid)
    k.start()
    node.kinetos.append(k)
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            st = (await converge(client, "c-requeue-001"))["rank-0"]
        assert st.state.value == "archived" and len(k.configs) == 1
    finally:
        await running.stop()


async def test_a_config_fetched_just_before_a_crash_is_the_targets_trace_after_the_restart(node):
    """The endpoint answers Kineto first and writes `delivered_at` after (Kineto waits ~50 ms for
    its answer): an agent killed between the two leaves Kineto tracing a config the state says was
    never fetched. The new agent queues the target again; the trace Kineto then writes is that
    config's and must be archived as the target's (seen in CI: failed, trace_id not the requested),
    and the second config must never reach Kineto (it would trace the rank twice into one file)."""
    p = node.worker(0, kineto=None)
    gate = threading.Event()
    k = FakeKineto(node.sock_dir, KJOB, p.pid, start_gate=gate)   # fetches, then traces when let
    running = await start_agent(node.options())
    running.endpoint.on_delivered = None    # the kill lands after the answer, before the write
    try:
        k.start()
        node.kinetos.append(k)
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-crash-001", "rank-0", dispatch(node, "c-crash-001", 0))
            while not k.configs:
                await asyncio.sleep(0.05)
            assert (await client.status("c-crash-001"))[0].state.value == "queued_by_dynolog"
    finally:
        await running.stop()
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            while not any(proc.pending for proc in running.endpoint.processes()):
                await asyncio.sleep(0.05)     # queued again, in the new endpoint's slot
            gate.set()                        # Kineto writes the config it fetched before the crash
            st = (await converge(client, "c-crash-001"))["rank-0"]
        assert st.state.value == "archived", (st.reason, st.detail)
        assert st.artifact.trace_id == k.configs[0]["REQUEST_TRACE_ID"]
        assert not any(proc.pending for proc in running.endpoint.processes()), "the second config is still out"
        assert len(k.configs) == 1
    finally:
        await running.stop()


async def test_archive_outage_is_retried_and_a_lasting_one_keeps_the_bytes(node, monkeypatch):
    for key, value in CREDS.items():
        monkeypatch.setenv(key, value)
    moto, endpoint = start_moto()
    proxy = SwitchableProxy(int(endpoint.rsplit(":", 1)[1]))
    try:
        import boto3
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="arch")
        procs = [node.worker(0), node.worker(1)]
        running = await start_agent(node.options(
            archive_root="s3://arch/root", s3_endpoint=proxy.endpoint,
            archive_policy=RetryPolicy(attempts=4, first_delay_s=0.5, max_delay_s=0.5)))
        try:
            async with AgentClient(running.url, TOKEN) as client:
                body = dispatch(node, "c-s3-outage1", 0, archive_prefix="s3://arch/root/ns/train/0/c-s3-outage1")
                await client.dispatch("c-s3-outage1", "rank-0", body)
                while "retrying" not in ((await client.status("c-s3-outage1"))[0].detail or ""):
                    await asyncio.sleep(0.05)
                await proxy.up()  # S3 is back
                ok = (await converge(client, "c-s3-outage1"))["rank-0"]
                await proxy.down()  # and gone for good
                body = dispatch(node, "c-s3-outage2", 1, archive_prefix="s3://arch/root/ns/train/0/c-s3-outage2")
                await client.dispatch("c-s3-outage2", "rank-1", body)
                bad = (await converge(client, "c-s3-outage2"))["rank-1"]
        finally:
            await running.stop()
        assert ok.state.value == "archived" and ok.artifact.uri == "s3://arch/root/ns/train/0/c-s3-outage1/traces/rank-0.json.gz"
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket="arch")["Contents"]]
        assert keys == ["root/ns/train/0/c-s3-outage1/traces/rank-0.json.gz"]
        assert bad.reason.value == "archive_failed" and "after 4 attempt(s)" in bad.detail
        assert (node.base / "traces" / "c-s3-outage2" / f"rank-1_{procs[1].pid}.json").exists()
    finally:
        await proxy.down()
        stop_process(moto)


# --- the API's refusals ---------------------------------------------------------------------------

async def raw(agent, method: str, path: str, *, token: str | None = TOKEN, data=None, json_body=None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, agent.url + path, headers=headers, data=data, json=json_body) as r:
            return r.status, await r.json(content_type=None)


async def test_every_api_route_needs_the_token(node, agent):
    path = "/v1/captures/c-auth-00001/targets/rank-0"
    for token in (None, "wrong", TOKEN + "x", ""):
        assert (await raw(agent, "PUT", path, token=token, json_body=dispatch(node, "c-auth-00001", 0)))[0] == 401
        assert (await raw(agent, "GET", "/v1/captures/c-auth-00001", token=token))[0] == 401
        assert (await raw(agent, "GET", "/v1/workers", token=token))[0] == 401
        assert (await raw(agent, "POST", "/v1/captures/c-auth-00001/cancel", token=token))[0] == 401
    assert (await raw(agent, "GET", "/v1/captures/c-auth-00001"))[0] == 404  # nothing was created
    assert (await raw(agent, "GET", "/healthz", token=None))[0] == 200
    with pytest.raises(AgentError) as err:
        await AgentClient(agent.url, "wrong").workers()
    assert err.value.kind == "unauthorized"


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.pop("duration_ms"), "duration_ms"),
    (lambda b: b.update(duration_ms="500"), "duration_ms"),
    (lambda b: b.update(activities=["cpu_op", "cuda_sync"]), "activities[1]"),
    (lambda b: b.update(rank=-1), "rank"),
    (lambda b: b.update(surprise=1), "surprise"),
    (lambda b: b.update(archive_prefix="file:///etc/elsewhere"), "archive_prefix"),
    (lambda b: b.update(archive_prefix="http://x/y"), "archive_prefix"),
    (lambda b: b.update(deadline=time.time() - 1), "deadline"),
    (lambda b: b.update(options={"with_stack": "yes"}), "options.with_stack"),
])
async def test_bad_bodies_get_400_naming_the_field(node, agent, mutate, field):
    body = dispatch(node, "c-badbody-001", 0)
    mutate(body)
    status, answer = await raw(agent, "PUT", "/v1/captures/c-badbody-001/targets/rank-0", json_body=body)
    assert status == 400 and answer["field"] == field, answer
    assert (await raw(agent, "GET", "/v1/captures/c-badbody-001"))[0] == 404


async def test_bad_ids_non_json_and_oversized_bodies(node, agent):
    body = dispatch(node, "c-ids-000001", 0)
    status, answer = await raw(agent, "PUT", "/v1/captures/UPPER_case/targets/rank-0", json_body=body)
    assert status == 400 and answer["field"] == "capture_id"
    status, answer = await raw(agent, "PUT", "/v1/captures/c-ids-000001/targets/rank.0", json_body=body)
    assert status == 400 and answer["field"] == "target_id"
    status, answer = await raw(agent, "PUT", "/v1/captures/c-ids-000001/targets/rank-0", data=b"{nope")
    assert status == 400 and "not JSON" in answer["error"]
    status, answer = await raw(agent, "PUT", "/v1/captures/c-ids-000001/targets/rank-0", json_body=[1, 2])
    assert status == 400
    huge = dict(body, pod="x" * (80 * 1024))
    status, answer = await raw(agent, "PUT", "/v1/captures/c-ids-000001/targets/rank-0", json_body=huge)
    assert status == 413 and "larger than" in answer["error"]
    assert (await raw(agent, "GET", "/v1/captures/c-ids-000001"))[0] == 404
    assert (await raw(agent, "POST", "/v1/captures/c-never-seen1/cancel"))[0] == 404


async def test_workers_lists_records_with_host_pids(node, agent):
    procs = [node.worker(0, kineto=None), node.worker(1, kineto=None)]
    procs[1].kill()
    procs[1].wait()
    async with AgentClient(agent.url, TOKEN) as client:
        workers = sorted(await client.workers(), key=lambda w: w.record.global_rank)
    assert [(w.record.global_rank, w.alive, w.host_pid) for w in workers] == [(0, True, procs[0].pid), (1, False, None)]


async def test_a_nearly_full_trace_folder_is_refused_before_triggering(node):
    """Issue 27's node guard: the trainers' trace folder is a 2 MiB tmpfs. A capture whose budget
    (4 MiB) would not fit ends `no_disk_space` with the numbers, and Kineto never got a config;
    one whose budget fits (256 KiB, no reserve) is traced and archived from the same folder."""
    from tests.tinyfs import tiny_fs
    fs = tiny_fs(node.base / "traces", size="2m", inodes=256)
    try:
        running = await start_agent(node.options(min_free_mb=0))
        try:
            node.worker(0)
            big = {"budget_bytes": 4 << 20, "estimate_bytes": 3 << 20}
            async with AgentClient(running.url, TOKEN) as client:
                await client.dispatch("c-no-room-01", "rank-0", dispatch(node, "c-no-room-01", 0, budget=big))
                st = (await converge(client, "c-no-room-01"))["rank-0"]
                assert (st.state.value, st.reason.value) == ("failed", "no_disk_space"), st
                assert str(node.base / "traces") in st.detail and "4.0 MiB" in st.detail, st.detail
                assert "refused before triggering" in st.detail
                assert node.kinetos[0].configs == []            # nothing was asked of the trainer
                small = {"budget_bytes": 256 << 10, "estimate_bytes": 100 << 10, "gpu_buffer_mb": 1}
                await client.dispatch("c-room-ok-01", "rank-0", dispatch(node, "c-room-ok-01", 0, budget=small))
                ok = (await converge(client, "c-room-ok-01"))["rank-0"]
            assert ok.state.value == "archived", ok
            assert ok.artifact.sizes["budget"] == 256 << 10 and ok.artifact.sizes["gpu_buffer_mb"] == 1
            assert len(node.kinetos[0].configs) == 1
        finally:
            await running.stop()
    finally:
        fs.close()


async def test_eight_ranks_of_one_node_are_guarded_together_not_each_alone(node):
    """Issue 43: the disk guard is per node. Eight ranks dispatched at once into a 6 MiB trace folder,
    each with a 1 MiB budget: each would fit alone, but only what the folder holds beside the others'
    claims is triggered; the rest end `no_disk_space` naming what the in-flight targets hold, before
    their trainers were asked. Once those traces are archived and gone, the claims end: the same
    ranks fit again."""
    from tests.tinyfs import tiny_fs
    fs = tiny_fs(node.base / "traces", size="6m", inodes=512)
    gate = threading.Event()
    try:
        running = await start_agent(node.options(min_free_mb=0, compress_level=0))
        try:
            for rank in range(8):
                node.worker(rank, start_gate=gate)
            one_mib = {"budget_bytes": 1 << 20, "estimate_bytes": 100 << 10, "gpu_buffer_mb": 1}
            async with AgentClient(running.url, TOKEN) as client:
                for rank in range(8):
                    await client.dispatch("c-eight-ranks", f"rank-{rank}",
                                          dispatch(node, "c-eight-ranks", rank, budget=one_mib))
                refused = await wait_for_count(client, "c-eight-ranks", lambda s: s.reason is not None
                                               and s.reason.value == "no_disk_space", at_least=1)
                gate.set()
                done = await converge(client, "c-eight-ranks")
                archived = [t for t, s in done.items() if s.state.value == "archived"]
                full = [s for s in done.values() if s.reason is not None and s.reason.value == "no_disk_space"]
                assert len(archived) + len(full) == 8, done
                # a 6 MiB tmpfs holds five 1 MiB claims with its own overhead, never all eight
                assert 1 <= len(full) and 4 <= len(archived) <= 6, done
                assert all("other in-flight targets of this node hold" in s.detail for s in full), full
                assert refused and sum(len(k.configs) for k in node.kinetos) == len(archived)   # the refused were never asked
                # the archived ranks' claims ended with them: the refused ranks fit now
                again = [int(s.target_id.split("-")[1]) for s in full]
                for rank in again:
                    await client.dispatch("c-eight-again", f"rank-{rank}",
                                          dispatch(node, "c-eight-again", rank, budget=one_mib))
                after = await converge(client, "c-eight-again")
            assert {s.state.value for s in after.values()} == {"archived"}, after
        finally:
            await running.stop()
    finally:
        fs.close()


async def wait_for_count(client: AgentClient, capture_id: str, pred, *, at_least: int, timeout: float = 30):
    end = time.time() + timeout
    while True:
        hits = [s for s in await client.status(capture_id) if pred(s)]
        if len(hits) >= at_least:
            return hits
        assert time.time() < end, await client.status(capture_id)
        await asyncio.sleep(0.1)


async def test_a_trace_whose_gzip_copy_meets_a_full_disk_is_archived_as_it_is(node):
    """Issue 43: no trace thrown away. The staging disk (a 256 KiB tmpfs) has room when the target is
    checked, then someone else fills it before the trace lands: the gzip copy hits ENOSPC. The trace
    verified, so it is archived uncompressed (its own checksum), not failed `no_disk_space` and left
    on the node."""
    from tests.tinyfs import tiny_fs
    staging_dir = node.base / "state" / "staging"
    staging_dir.mkdir(parents=True)
    fs = tiny_fs(staging_dir, size="256k", inodes=64)
    gate = threading.Event()
    try:
        running = await start_agent(node.options(min_free_mb=0))
        try:
            node.worker(0, start_gate=gate)
            small = {"budget_bytes": 32 << 10, "estimate_bytes": 8 << 10, "gpu_buffer_mb": 1}
            async with AgentClient(running.url, TOKEN) as client:
                await client.dispatch("c-full-staging", "rank-0", dispatch(node, "c-full-staging", 0, budget=small))
                await wait_for_count(client, "c-full-staging", lambda s: s.state.value == "queued_by_dynolog", at_least=1)
                fd = os.open(staging_dir / "someone-else", os.O_WRONLY | os.O_CREAT)   # the disk fills meanwhile
                try:
                    while os.write(fd, b"\0" * 4096):
                        pass
                except OSError:
                    pass
                finally:
                    os.close(fd)
                gate.set()
                st = (await converge(client, "c-full-staging"))["rank-0"]
        finally:
            await running.stop()
        assert st.state.value == "archived", (st.reason, st.detail)
        assert "archived uncompressed" in st.detail and "No space left" in st.detail, st.detail
        art = st.artifact
        assert art.uri.endswith("/traces/rank-0.json") and art.sizes["encoding"] == "identity"
        stored = Path(art.uri.removeprefix("file://")).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == art.sha256 and len(stored) == art.size == art.sizes["uncompressed"]
        assert json.loads(stored)["traceEvents"]
        assert [p.name for p in staging_dir.iterdir()] == ["someone-else"]          # no part file left behind
    finally:
        fs.close()
