"""The node agent in its container, as the chart runs it (root with only DAC_READ_SEARCH and
SYS_PTRACE, hostPID, host network, read-only root, no new privileges, the registry, trace, socket
and state folders as host bind mounts at the same paths), captures an armed two-worker torch
trainer running in ANOTHER container (its own pid namespace, uid 1000).

The trainer container is plain bookworm with Debian's python3; torch comes from the host venv's
site-packages, mounted read-only (no torch in any image), and the gpulens hook from the
repository's hooks/ folder, mounted read-only, armed through PYTHONPATH as the README says.

Asserted: both ranks archived, each archive's bytes match the sha256 and size the agent reports,
the trace names the worker's own (container-namespace) pid, and the agent resolved each worker's
container pid to the host pid that this test finds independently through /proc/<pid>/status NSpid.
"""

from __future__ import annotations

import asyncio
import hashlib
import gzip
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.hooks import hook_path

from .conftest import REPO, podman, wait_http
from tests.conftest import free_port

pytestmark = [pytest.mark.container, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "agent-container-token"
TRAINER = REPO / "tests" / "agent" / "trainer.py"
WINDOW_MS = 1500


@pytest.fixture(scope="module")
def trainer_image(image) -> str:
    """Plain bookworm with Debian's python3 (the same 3.11 the host venv's wheels were built for)."""
    tag = "localhost/gpulens-test-python:bookworm"
    if podman("image", "exists", tag, check=False).returncode != 0:
        ctx = Path(tempfile.mkdtemp(prefix="gl-pyimg-"))
        try:
            (ctx / "Containerfile").write_text(
                "FROM docker.io/library/debian:bookworm-slim\n"
                "RUN apt-get update && apt-get install -y --no-install-recommends python3 "
                "&& rm -rf /var/lib/apt/lists/*\n")
            podman("build", "--pull=never", "-q", "-t", tag, str(ctx), timeout=900)
        finally:
            shutil.rmtree(ctx, ignore_errors=True)
    return tag


def _host_pids_in(ns_pid_link: str) -> dict[int, int]:
    """{pid inside that namespace: host pid} for every process in the pid namespace `ns_pid_link`."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "ns" / "pid") != ns_pid_link:
                continue
            nspid = next(line for line in (d / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        ids = [int(x) for x in nspid.split()[1:]]
        out[ids[-1]] = ids[0]
    return out


async def _converge(client: AgentClient, capture_id: str, timeout: float = 180) -> dict:
    end = time.time() + timeout
    statuses = None
    while time.time() < end:
        statuses = await client.status(capture_id) or []
        if statuses and all(s.terminal for s in statuses):
            return {s.target_id: s for s in statuses}
        await asyncio.sleep(0.25)
    raise AssertionError(f"{capture_id} did not converge: {statuses}")


async def test_agent_in_container_captures_a_trainer_in_another_container(image, trainer_image, containers):
    base = Path(tempfile.mkdtemp(prefix="gl-ctr-", dir="/var/tmp"))
    sock = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp"))     # short: Unix socket paths have 108 bytes
    try:
        dirs = {n: base / n for n in ("registry", "traces", "state", "archive", "tokens")}
        for n, d in dirs.items():
            d.mkdir()
            os.chmod(d, 0o1777 if n in ("registry", "traces") else 0o755)
        os.chmod(sock, 0o1777)                               # what the chart's prepare-dirs does
        (dirs["tokens"] / "agent").write_text(TOKEN + "\n")
        os.chmod(dirs["tokens"] / "agent", 0o644)
        stop = dirs["traces"] / "stop"                       # a path the trainer container sees
        site = str(Path(__import__("torch").__file__).parents[1])
        hooks = str(hook_path())
        same = lambda p, mode="": ("-v", f"{p}:{p}{mode}")  # noqa: E731  hostPath: same path inside

        trainer = containers.start(
            "trainer", trainer_image, "python3", "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--master-port={free_port()}", str(TRAINER), str(stop), "400",
            run_opts=("--user", "1000:1000", "--network", "none", "--cap-drop", "ALL",
                      *same(site, ":ro"), *same(hooks, ":ro"), *same(TRAINER, ":ro"),
                      *same(dirs["registry"]), *same(dirs["traces"]), *same(sock),
                      "-e", f"PYTHONPATH={hooks}:{site}", "-e", "HOME=/tmp", "-e", "OMP_NUM_THREADS=1",
                      "-e", "GPULENS_JOB_ID=ctr", "-e", f"GPULENS_REGISTRY_DIR={dirs['registry']}",
                      "-e", f"GPULENS_SOCKET_DIR={sock}", "-e", f"GPULENS_TRACE_DIR={dirs['traces']}"))
        deadline = time.monotonic() + 240
        while len(list(dirs["registry"].glob("*.json"))) < 2:
            assert trainer.running(), trainer.logs()[-4000:]
            assert time.monotonic() < deadline, f"no registration records:\n{trainer.logs()[-4000:]}"
            await asyncio.sleep(0.3)
        # Records are written at interpreter start; Kineto can trace only once `import torch` is
        # done (the trainer prints "ready <pid>" then). Tracing earlier records no ops.
        while trainer.logs().count("ready ") < 2:
            assert trainer.running(), trainer.logs()[-4000:]
            assert time.monotonic() < deadline, f"workers not ready:\n{trainer.logs()[-4000:]}"
            await asyncio.sleep(0.3)
        records = sorted((json.loads(f.read_text()) for f in dirs["registry"].glob("*.json")),
                         key=lambda r: r["global_rank"])
        assert [r["global_rank"] for r in records] == [0, 1]

        port = free_port()
        agent = containers.start(
            "agent", image, "agent", f"--listen=127.0.0.1:{port}", "--node=test-node",
            f"--registry-dir={dirs['registry']}", f"--trace-dir={dirs['traces']}", f"--state-dir={dirs['state']}",
            f"--socket-dir={sock}", f"--archive-root=file://{dirs['archive']}", "--trigger=builtin",
            "--token-file=/var/run/gpulens/tokens/agent",
            run_opts=("--pid", "host", "--network", "host", "--user", "0", "--cap-drop", "ALL",
                      "--cap-add", "DAC_READ_SEARCH,SYS_PTRACE", "--read-only", "--security-opt", "no-new-privileges",
                      "--tmpfs", "/tmp", *same(dirs["registry"]), *same(dirs["traces"]), *same(sock),
                      *same(dirs["state"]), *same(dirs["archive"]),
                      "-v", f"{dirs['tokens']}:/var/run/gpulens/tokens:ro"))
        wait_http(f"http://127.0.0.1:{port}/healthz", agent)

        # The workers' pids as their own namespace sees them, and as the host does.
        trainer_pid = int(podman("inspect", "--format", "{{.State.Pid}}", trainer.name).stdout)
        host_of = _host_pids_in(os.readlink(f"/proc/{trainer_pid}/ns/pid"))
        assert {r["pid"] for r in records} <= set(host_of), (records, host_of)
        assert all(host_of[r["pid"]] != r["pid"] for r in records)      # really another pid namespace

        capture_id = "c-container-agent"
        async with AgentClient(f"http://127.0.0.1:{port}", TOKEN) as client:
            end = time.monotonic() + 60
            while True:
                workers = {w.record.global_rank: w for w in await client.workers() if w.record.job_id == "ctr"}
                if len(workers) == 2 and all(w.alive for w in workers.values()) or time.monotonic() > end:
                    break
                await asyncio.sleep(0.3)
            for r in records:
                assert workers[r["global_rank"]].host_pid == host_of[r["pid"]], (workers, host_of)
            for r in records:
                await client.dispatch(capture_id, f"rank-{r['global_rank']}", {
                    "job_id": "ctr", "attempt": 0, "rank": r["global_rank"], "duration_ms": WINDOW_MS,
                    "activities": ["cpu_op"], "options": {"with_stack": True}, "deadline": time.time() + 150,
                    "archive_prefix": f"file://{dirs['archive']}/default/ctr/0/{capture_id}"})
            done = await _converge(client, capture_id)
        for r in records:
            st = done[f"rank-{r['global_rank']}"]
            assert st.state.value == "archived", (st, agent.logs()[-3000:])
            art = st.artifact
            data = Path(art.uri.removeprefix("file://")).read_bytes()
            assert hashlib.sha256(data).hexdigest() == art.sha256 and len(data) == art.size
            assert (art.rank, art.pid) == (r["global_rank"], r["pid"])
            assert art.uri.endswith(".json.gz")            # stored compressed, checksum of the stored bytes
            trace = json.loads(gzip.decompress(data))
            assert {e["pid"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"} == {r["pid"]}
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
