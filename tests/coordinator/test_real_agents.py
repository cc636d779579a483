"""Fan-out across two real `gpulens agent` processes (builtin trigger: the agent answers Kineto's
IPC socket itself), each with a real armed PyTorch (CPU) worker in Kineto daemon mode. One agent
is killed mid-capture: its target ends `agent_unreachable`, the other is archived (a real,
checksummed trace), `gpulens capture start --wait` exits 3, and the manifest names the missing rank.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpulens.capture.coordinator import DeadlinePolicy, FanoutSettings, make_app
from gpulens.capture.wire.auth import Credentials, SecretFile
from gpulens.capture.models import Manifest

from .conftest import AGENT_TOKEN, make_coordinator
from .real_nodes import Node
from .servers import REPO, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TOKEN = "coordinator-token"
#: the nominal dynolog/Kineto path (poll <= 5 s + 7 s warm-up), tight margins: a 600 ms window
REAL = DeadlinePolicy(start_delay_s=12.0, dispatch_s=2.0, write_s=3.0, write_per_window=0.5, archive_s=8.0,
                      report_s=4.0)


async def test_one_real_agent_killed_mid_capture(tmp_path, http):
    base = Path(tempfile.mkdtemp(prefix="gl-fanout-", dir="/var/tmp"))   # not /tmp: Kineto's own default
    archive, stop_file, shared_reg = base / "archive", base / "stop", base / "registry"
    token = base / "agent.token"
    token.write_text(AGENT_TOKEN)
    nodes = [Node("node-a", base, archive), Node("node-b", base, archive)]
    try:
        for rank, node in enumerate(nodes):
            node.start_trainer(rank, len(nodes), stop_file)
        await asyncio.gather(*(n.start_agent(token) for n in nodes))
        end = time.time() + 180
        while not all(n.records() for n in nodes):
            assert time.time() < end, "the trainers did not register"
            for n in nodes:
                assert n.trainer.poll() is None, (n.base / "trainer.log").read_text()[-2000:]
            await asyncio.sleep(0.3)
        # the coordinator's registry view (in a cluster each agent reports its own node's records)
        shared_reg.mkdir()
        for n in nodes:
            for rec in n.records():
                (shared_reg / rec.name).symlink_to(rec)
        await asyncio.sleep(1.0)                  # let each agent pick up its worker

        c = make_coordinator(tmp_path, http, {n.name: n.url for n in nodes}, registry=shared_reg, policy=REAL,
                             fanout=FanoutSettings(poll_interval_s=0.5, max_poll_interval_s=2.0),
                             archive_root=f"file://{archive}")
        (tmp_path / "c.token").write_text(TOKEN)
        async with serving(make_app(c, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)))) as url:
            env = {**os.environ, "GPULENS_TOKEN": TOKEN}
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpulens.cli", "capture", "start", "--job", "train", "--duration-ms", "600",
                "--wait", "--url", url, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            # kill node-b's agent once it has accepted its target (mid-capture, before any trace exists)
            end = time.time() + 60
            while True:
                rec = next(iter(c.captures.values()), None)
                p = rec.targets.get("rank-1") if rec else None
                if p is not None and p.accepted:
                    break
                assert time.time() < end, "the dispatch to node-b never landed"
                await asyncio.sleep(0.05)
            killed_in_state = p.state.value
            await nodes[1].agent.stop(signal.SIGKILL)
            out, err = await asyncio.wait_for(cli.communicate(), 200)
        assert cli.returncode == 3, (out, err, (nodes[0].base / "agent.log").read_text()[-3000:])
        cid, manifest_uri = out.decode().split()
        assert "missing ranks [1]" in err.decode()
        m = Manifest.from_json(Path(manifest_uri.removeprefix("file://")).read_text())
        assert m.capture_id == cid and m.missing_ranks == [1]
        (fail,) = m.failures
        assert (fail.target_id, fail.rank, fail.reason) == ("rank-1", 1, "agent_unreachable")
        assert killed_in_state in fail.detail
        (art,) = m.artifacts
        assert (art.rank, art.node, art.pod) == (0, "node-a", "train-0")
        data = Path(art.uri.removeprefix("file://")).read_bytes()
        assert hashlib.sha256(data).hexdigest() == art.sha256 and len(data) == art.size
        trace = json.loads(gzip.decompress(data))   # archived as gzip (issue 27)
        assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])       # a real Kineto trace
    finally:
        stop_file.touch()
        await asyncio.gather(*(n.stop() for n in nodes))
        shutil.rmtree(base, ignore_errors=True)
