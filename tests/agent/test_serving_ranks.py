"""A serving capture numbers replicas apart (every replica's worker registered rank 0): the agent
finds the worker by the rank it registered (`worker_rank`) and archives it under the capture's
rank, so two replicas' traces never share a name or a manifest rank (issue 30)."""

from __future__ import annotations

from gpulens.capture.agent.client import AgentClient

from tests.agent.test_agent import TOKEN, agent, converge, dispatch, node  # noqa: F401 - fixtures


async def test_the_worker_is_found_by_its_registered_rank_and_archived_under_the_capture_rank(node, agent):  # noqa: F811
    proc = node.worker(0)
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-serving-ranks", "rank-1", dispatch(node, "c-serving-ranks", 1, worker_rank=0))
        await client.dispatch("c-serving-ranks", "rank-2", dispatch(node, "c-serving-ranks", 2))
        done = await converge(client, "c-serving-ranks")
    st = done["rank-1"]
    assert st.state.value == "archived", st
    assert st.artifact.rank == 1 and st.artifact.pid == proc.pid
    # the manifest says which rank the worker itself reports: analysis checks its trace against it
    assert st.artifact.worker_rank == 0 and st.artifact.to_dict()["worker_rank"] == 0
    assert st.artifact.uri.endswith("/traces/rank-1.json.gz")
    # without worker_rank the capture rank is the registered rank: nobody registered rank 2
    assert done["rank-2"].state.value == "failed" and done["rank-2"].reason.value == "not_registered", done["rank-2"]
