"""A newcomer's mistakes with `gpulens capture` (a real subprocess) against a real gateway in front of
a real coordinator: each one -> the cause in words, what to do next, the documented exit code, and
never an HTTP status line, an exception class name or a query string in place of a flag.

Also: manual captures are idempotent end to end (the CLI picks the id; a stalled coordinator makes
the answer "outcome unknown", and the retry with the same id returns the same capture)."""

from __future__ import annotations

import asyncio
import re
import socket

import aiohttp
import pytest
from aiohttp import web

from tests.client.test_cli import cli
from tests.coordinator.servers import serving
from tests.gateway.conftest import GATEWAY_TOKEN, gateway_for, http, stack  # noqa: F401  (fixtures)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CID = "c-20260101t000000-deadbeef"
CLOSED = _closed_port()

# (argv, token, url, exit code, fragments that must all be in stderr)
MISTAKES = [
    (["start", "--namespace", "ml", "--job", "train"], None, None, 4,
     ["none was given", "GPULENS_TOKEN", "--token-file"]),
    (["start", "--namespace", "ml", "--job", "train"], "wrong", None, 4,
     ["refused the token from GPULENS_TOKEN", "next:"]),
    (["start", "--namespace", "ml", "--job", "train", "--token-file", "{tmp}/wrong.token"], None, None, 4,
     ["refused the token from --token-file", "wrong.token"]),
    (["start", "--namespace", "ml", "--job", "train", "--token-file", "{tmp}/missing.token"], None, None, 2,
     ["--token-file", "cannot be read", "GPULENS_TOKEN"]),
    (["start", "--job", "train"], GATEWAY_TOKEN, None, 2,
     ["--namespace", "routes by namespace", "known jobs: ml/train"]),
    (["start", "--namespace", "ml", "--job", "nope"], GATEWAY_TOKEN, None, 2,
     ["no coordinator is known for ml/nope", "known jobs: ml/train", "--job"]),
    (["start", "--namespace", "ml", "--pod", "ghost-0"], GATEWAY_TOKEN, None, 2,
     ["pod ml/ghost-0 belongs to no known job", "known jobs: ml/train"]),
    (["start", "--namespace", "ml"], GATEWAY_TOKEN, None, 2, ["say which job", "--job JOB"]),
    (["start", "--pod", "train-0"], GATEWAY_TOKEN, None, 2, ["--pod needs --namespace"]),
    (["start", "--namespace", "ml", "--job", "train", "--activities", "cpu_op,bogus"], GATEWAY_TOKEN, None, 2,
     ["--activities", "bogus", "valid values: cpu_op,"]),
    (["start", "--namespace", "ml", "--job", "train", "--duration-ms", "5"], GATEWAY_TOKEN, None, 2,
     ["--duration-ms"]),
    (["start", "--namespace", "ml", "--job", "train", "--capture-id", "Bad Id!"], GATEWAY_TOKEN, None, 2,
     ["--capture-id"]),
    (["start", "--namespace", "ml", "--job", "train", "--duration-ms", "abc"], GATEWAY_TOKEN, None, 2,
     ["--duration-ms", "invalid int value"]),
    (["start", "--namespace", "ml", "--job", "train", "--bogus-flag"], GATEWAY_TOKEN, None, 2,
     ["unrecognized arguments: --bogus-flag", "--help"]),
    (["start", "--namespace", "ml", "--job", "train"], GATEWAY_TOKEN, "127.0.0.1:9453", 2,
     ["not an http:// or https:// URL", "--url http://127.0.0.1:9453"]),
    (["start", "--namespace", "ml", "--job", "train"], GATEWAY_TOKEN, f"http://127.0.0.1:{CLOSED}", 4,
     [f"nothing answers at 127.0.0.1:{CLOSED}", "outcome unknown", "gpulens capture status c-"]),
    (["status", CID], GATEWAY_TOKEN, f"http://127.0.0.1:{CLOSED}", 4,
     ["connection refused", "GPULENS_URL"]),
    (["status", CID], GATEWAY_TOKEN, None, 4, [f"{CID}: unknown capture", "gpulens capture list"]),
    (["watch", CID], GATEWAY_TOKEN, None, 4, [f"{CID}: unknown capture"]),
    (["cancel", CID], GATEWAY_TOKEN, None, 4, [f"{CID}: unknown capture"]),
    (["start", "--namespace", "ml", "--job", "train", "--hang", "--iterations", "10"], GATEWAY_TOKEN, None, 2,
     ["--hang reads each rank as it is now", "--iterations"]),
    (["list", "--namespace", "ml"], GATEWAY_TOKEN, None, 2, ["--namespace and --job go together"]),
    (["list", "--namespace", "ml", "--job", "nope"], GATEWAY_TOKEN, None, 4, ["ml/nope"]),
]

NEVER = [re.compile(p) for p in (r"HTTP \d", r"\b[A-Z][A-Za-z]*(Error|Exception)\b", r"Traceback", r"\?namespace=",
                                 r"ssl:default")]


@pytest.mark.parametrize("argv,token,url,code,fragments", MISTAKES,
                         ids=[f"{i}-{' '.join(m[0][:3])}" for i, m in enumerate(MISTAKES)])
async def test_each_mistake_says_why_and_what_next_with_the_documented_exit_code(stack, tmp_path, argv, token, url,
                                                                                 code, fragments):
    (tmp_path / "wrong.token").write_text("not-the-token")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, out, err = await cli(*argv, token=token, url=url or stack.url, timeout=60)
    assert rc == code, (rc, out, err)
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    for pattern in NEVER:
        assert not pattern.search(err), (pattern.pattern, err)
    assert stack.coordinator.captures == {} or argv[0] == "list"


async def test_a_second_capture_while_one_runs_names_it_and_says_wait(stack):
    stack.agent.outcome = lambda d, t: "hang"   # still running when the second request comes, even under load
    rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--duration-ms", "60000",
                             url=stack.url, token=GATEWAY_TOKEN)
    assert rc == 0, err
    first = out.strip()
    rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", url=stack.url, token=GATEWAY_TOKEN)
    assert rc == 4 and f"still running ({first})" in err and f"gpulens capture watch {first}" in err, err
    assert out == "" and list(stack.coordinator.captures) == [first]


async def test_the_cli_picks_the_id_and_a_retry_with_it_returns_the_same_capture(stack):
    rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--duration-ms", "200",
                             url=stack.url, token=GATEWAY_TOKEN)
    assert rc == 0, err
    cid = out.strip()
    assert re.fullmatch(r"c-\d{8}t\d{6}-[0-9a-f]{8}", cid)
    assert "already started" not in err
    cooldown_from = stack.gateway.ledger.last_start["ml/train"]
    rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--capture-id", cid, "--wait",
                             url=stack.url, token=GATEWAY_TOKEN)
    assert rc == 0, err
    assert out.split()[0] == cid and "already started by an earlier request with the same id" in err
    assert list(stack.coordinator.captures) == [cid]                    # one capture, not two
    assert stack.gateway.ledger.last_start["ml/train"] == cooldown_from  # a retry does not restart the cooldown


class StallingCoordinator:
    """Stands for a coordinator whose answer to the first POST /v1/captures comes late (a stalled
    process that resumes): the request reaches the real coordinator at once, byte for byte, and its
    answer is held `delay_s` (longer than the gateway waits). Every other request passes straight."""

    def __init__(self, upstream: str, delay_s: float):
        self.upstream, self.delay_s, self.stalled = upstream, delay_s, 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, self.upstream + request.path_qs, data=body, headers=headers) as r:
                data, status, ctype = await r.read(), r.status, r.headers.get("Content-Type", "application/json")
        if request.method == "POST" and request.path == "/v1/captures" and not self.stalled:
            self.stalled += 1
            await asyncio.sleep(self.delay_s)
        return web.Response(body=data, status=status, headers={"Content-Type": ctype})


async def test_a_stalled_coordinator_gives_outcome_unknown_and_the_retry_returns_that_capture(stack, tmp_path, http):
    proxy = StallingCoordinator(stack.coordinator_url, delay_s=4.0)   # the gateway waits 2 s
    async with serving(proxy.app()) as purl:
        gw, serve = await gateway_for(tmp_path / "gw2", http, {"ml/train": purl})
        async with serve as gurl:
            rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--duration-ms", "200",
                                     url=gurl, token=GATEWAY_TOKEN)
            assert rc == 4 and out == "", (out, err)
            m = re.search(r"outcome unknown .*\n  next: gpulens capture status (c-\S+)", err)
            assert m, err
            cid = m.group(1)
            assert "coordinator is unavailable" in err
            assert list(stack.coordinator.captures) == [cid]              # it did start, as the message warned
            rc, out, err = await cli("status", cid, url=gurl, token=GATEWAY_TOKEN)
            assert rc == 0 and cid in out, err
            rc, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--capture-id", cid, "--wait",
                                     url=gurl, token=GATEWAY_TOKEN)
            assert rc == 0 and out.split()[0] == cid, err
            assert list(stack.coordinator.captures) == [cid]


def test_people_read_queued_whichever_trigger_holds_the_config():
    """`queued_by_dynolog` is the wire name; with the builtin endpoint no dynolog runs, so the text
    view says `queued` (the --json view keeps the wire name)."""
    from gpulens.capture.client.render import format_event, format_status
    status = {"capture_id": CID, "phase": "capturing", "counts": {"queued_by_dynolog": 1},
              "targets": [{"target_id": "rank-0", "state": "queued_by_dynolog", "pod": "p", "node": "n"}]}
    text = format_status(status) + "\n" + format_event({"event": "target", "target_id": "rank-0",
                                                        "state": "queued_by_dynolog", "at": 1.0})
    assert "queued_by_dynolog" not in text and "queued 1" in text and text.count("queued") == 3
