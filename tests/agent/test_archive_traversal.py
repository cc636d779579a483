"""Agent dispatch refuses an archive prefix that escapes its --archive-root in any spelling (plain,
percent-encoded, doubly encoded), with 400 `archive_prefix`, and writes nothing outside the root."""

from __future__ import annotations


import aiohttp
import pytest

from tests.agent.test_agent import JOB, TOKEN, agent, dispatch, node  # noqa: F401 - fixtures


@pytest.mark.parametrize("escape", ["..", "%2e%2e", "%252e%252e", "%2e%2e%2f%2e%2e", ".%2E", "x%00"])
async def test_escaping_prefixes_are_refused_and_nothing_is_written(node, agent, escape):
    canary = node.base / "canary"
    before = sorted(p for p in node.base.parent.rglob("*") if "archive" not in p.parts)
    prefix = f"{node.archive_root}/{escape}/{escape}/ns/{JOB}/0/c-escape00001"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        async with s.put(agent.url + "/v1/captures/c-escape00001/targets/rank-0",
                         json=dispatch(node, "c-escape00001", 0, archive_prefix=prefix)) as r:
            body = await r.json()
            assert r.status == 400 and body["field"] == "archive_prefix", body
        async with s.get(agent.url + "/v1/captures/c-escape00001") as r:
            assert r.status == 404
    assert not canary.exists()
    assert sorted(p for p in node.base.parent.rglob("*") if "archive" not in p.parts) == before




@pytest.mark.parametrize("capture_id, target_id, field", [
    ("c-newline0001%0A", "rank-0", "capture_id"), ("c-newline0001%0a", "rank-0", "capture_id"),
    ("%0Ac-newline0001", "rank-0", "capture_id"), ("c-newline0001", "rank-0%0A", "target_id"),
])
async def test_a_newline_in_a_path_id_is_400(node, agent, capture_id, target_id, field):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        async with s.put(f"{agent.url}/v1/captures/{capture_id}/targets/{target_id}",
                         json=dispatch(node, "c-newline0001", 0)) as r:
            body = await r.json()
            assert r.status == 400 and body["field"] == field, body
        async with s.get(agent.url + "/v1/captures/c-newline0001") as r:
            assert r.status == 404
