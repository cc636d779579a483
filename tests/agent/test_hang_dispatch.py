"""A hang dispatch at a real agent (issue 45), on workers nobody armed for it: a plain Python
process that never formed a process group (no Flight Recorder socket: its stacks alone are
archived, the dump's reason in the document), a process that is not Python at all (neither half:
`no_hang_evidence`, nothing archived), one that is gone, and requests the agent must refuse.
No Kineto stands by any of them: a hang capture never waits for one."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from gpulens.capture import schemas
from gpulens.capture.agent.client import AgentClient, AgentError

from tests.agent.test_agent import TOKEN, Node, agent, converge, dispatch, node  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.root]


def hang(node: Node, capture_id: str, rank: int) -> dict:
    return dispatch(node, capture_id, rank, kind="hang", deadline=time.time() + 45)


async def test_a_python_worker_without_a_process_group_is_archived_with_its_stacks(node, agent):
    proc = node.worker(0, kineto=None)
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-hang-py", "rank-0", hang(node, "c-hang-py", 0))
        done = await converge(client, "c-hang-py")
    st = done["rank-0"]
    assert st.state.value == "archived", (st.reason, st.detail)
    art = st.artifact
    assert art.kind == "hang_evidence" and art.trace_id is None and art.pid == proc.pid
    assert art.sizes["stored"] == art.sizes["uncompressed"] == art.size and art.sizes["encoding"] == "identity"
    assert art.uri == f"{node.prefix('c-hang-py')}/traces/rank-0.hang.json"
    data = Path(art.uri.removeprefix("file://")).read_bytes()
    assert hashlib.sha256(data).hexdigest() == art.sha256 and len(data) == art.size
    doc = schemas.validate("hang_evidence", json.loads(data))
    assert (doc["capture_id"], doc["target_id"], doc["rank"], doc["host_pid"]) == ("c-hang-py", "rank-0", 0, proc.pid)
    assert doc["flight_recorder"]["dump"] is None and doc["flight_recorder"]["reason"] == "no_socket"
    frames = [f for t in doc["stacks"]["doc"]["threads"] for f in t["frames"]]
    assert any(f["name"] == "<module>" for f in frames), frames          # read from outside, its own frames
    assert "no Flight Recorder dump (no_socket)" in st.detail and "stacks of 1 threads" in st.detail, st.detail
    assert not list((node.base / "state" / "staging").glob("*.hang.json"))      # the staged copy went
    assert not (node.base / "traces" / "c-hang-py").exists()      # the folder made for the hook's dump went too


async def test_a_worker_that_is_not_python_fails_with_both_reasons_and_nothing_archived(node, agent):
    node.worker(0, kineto=None, argv=["sleep", "120"])
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-hang-c", "rank-0", hang(node, "c-hang-c", 0))
        done = await converge(client, "c-hang-c")
    st = done["rank-0"]
    assert (st.state.value, st.reason.value) == ("failed", "no_hang_evidence"), (st.reason, st.detail)
    assert "no_socket" in st.detail and "not_python" in st.detail, st.detail
    assert st.artifact is None
    assert not list((node.base / "archive").rglob("*.hang.json"))


async def test_a_worker_gone_before_the_hang_dispatch_fails_process_gone(node, agent):
    proc = node.worker(0, kineto=None)
    proc.kill()
    proc.wait()
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-hang-gone", "rank-0", hang(node, "c-hang-gone", 0))
        done = await converge(client, "c-hang-gone")
    st = done["rank-0"]
    assert (st.state.value, st.reason.value) == ("failed", "process_gone"), (st.reason, st.detail)


async def test_a_dispatch_of_an_unknown_kind_is_refused_and_nothing_is_started(node, agent):
    node.worker(0, kineto=None)
    async with AgentClient(agent.url, TOKEN) as client:
        with pytest.raises(AgentError) as err:
            await client.dispatch("c-hang-bad", "rank-0", dispatch(node, "c-hang-bad", 0, kind="stacks"))
        assert err.value.status == 400 and err.value.field == "kind", (err.value, err.value.field)
        assert await client.status("c-hang-bad") is None
