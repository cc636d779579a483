"""The dynolog RPC client against the protocol-faithful double, and against broken servers."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpulens.capture.agent.metrics import AgentMetrics
from gpulens.capture.dynolog import DynologClient, DynologRefused, OnDemandResult, PidOutcome, TriggerFailed
from gpulens.capture.dynolog.rpc import encode_frame
from tests.conftest import free_port
from tests.doubles.dynolog_double import DynologDouble

CONFIG = "ACTIVITIES_LOG_FILE=/t/c/rank-0.json\nACTIVITIES_DURATION_MSECS=500"


async def raw_call(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_version_and_status(double):
    client = DynologClient("127.0.0.1", double.port)
    assert await client.get_version() == "0.6.0"
    assert await client.get_status() == 1


async def test_answers_are_compact_sorted_json_with_a_le_length(double, poller_factory):
    # byte-level check of the double itself (what dyno and the agent parse)
    await poller_factory(double.socket_dir, 7, [100, 50]).apoll()
    body = json.dumps({"fn": "setKinetOnDemandRequest", "config": CONFIG, "pids": [100], "job_id": 7}).encode()
    data = await raw_call(double.port, struct.pack("<i", len(body)) + body)
    (size,) = struct.unpack_from("<i", data)
    assert data[4:] == (b'{"activityProfilersBusy":0,"activityProfilersTriggered":[100],"eventProfilersBusy":0,'
                        b'"eventProfilersTriggered":[],"processesMatched":[100]}') and size == len(data) - 4


async def test_queued_busy_and_not_matched_are_told_apart(double, poller_factory):
    client = DynologClient("127.0.0.1", double.port)
    worker = poller_factory(double.socket_dir, 7, [100, 50, 1])
    other_pod = poller_factory(double.socket_dir, 8, [100, 60, 1])  # same pid 100, another job id
    assert await worker.apoll() == "" and await other_pod.apoll() == ""

    first = await client.set_kineto_ondemand_request(CONFIG, [100], 7)
    assert first.outcome_for(100) is PidOutcome.QUEUED
    assert first.processes_matched == (100,)  # pid 100 of job 8 is not touched
    # not fetched yet: the slot is full, so a second request is busy (and is not installed)
    second = await client.set_kineto_ondemand_request(CONFIG.replace("rank-0", "rank-0b"), [100], 7)
    assert second.outcome_for(100) is PidOutcome.WAITING_FOR_SLOT and second.activity_busy == 1
    # a tracing Kineto polls without the activities bit: nothing is handed over, still busy
    assert await worker.apoll(config_type=1) == ""
    assert (await client.set_kineto_ondemand_request(CONFIG, [100], 7)).outcome_for(100) is PidOutcome.WAITING_FOR_SLOT
    # the next idle poll fetches the FIRST config, with dynolog's trace id line and a newline
    got = await worker.apoll()
    assert "rank-0.json" in got and "rank-0b" not in got and "\n    REQUEST_TRACE_ID=" in got and got.endswith("\n")
    assert await other_pod.apoll() == ""  # the other pod never gets it
    assert (await client.set_kineto_ondemand_request(CONFIG, [100], 7)).outcome_for(100) is PidOutcome.QUEUED
    assert (await client.set_kineto_ondemand_request(CONFIG, [4242], 7)).outcome_for(4242) is PidOutcome.NOT_MATCHED
    assert (await client.set_kineto_ondemand_request(CONFIG, [100], 9)).outcome_for(100) is PidOutcome.NOT_MATCHED


async def test_dynolog_matches_through_ancestors_and_zero_means_all(double, poller_factory):
    """Why the agent always sends the worker's own pid and its per-pod job id: dynolog matches a
    process when ANY pid of its registered set is requested, and [0] means every process."""
    client = DynologClient("127.0.0.1", double.port)
    for leaf in (101, 102):
        await poller_factory(double.socket_dir, 7, [leaf, 50, 1]).apoll()
    via_launcher = await client.call({"fn": "setKinetOnDemandRequest", "config": CONFIG, "pids": [50], "job_id": 7})
    assert sorted(via_launcher["activityProfilersTriggered"]) == [101, 102]
    for leaf in (201, 202):
        await poller_factory(double.socket_dir, 3, [leaf, 60]).apoll()
    everyone = await client.call({"fn": "setKinetOnDemandRequest", "config": CONFIG, "pids": [0], "job_id": 3,
                                  "process_limit": 1})
    assert len(everyone["processesMatched"]) == 2 and len(everyone["activityProfilersTriggered"]) == 1
    limited = OnDemandResult.from_body(everyone)
    untriggered = [p for p in limited.processes_matched if p not in limited.activity_triggered][0]
    assert limited.outcome_for(untriggered) is PidOutcome.LIMITED


async def test_client_refuses_ambiguous_targets():
    client = DynologClient("127.0.0.1", 1)
    for pids in ([], [0], [-3]):
        with pytest.raises(ValueError):
            await client.set_kineto_ondemand_request(CONFIG, pids, 7)
    with pytest.raises(ValueError):
        await client.set_kineto_ondemand_request(CONFIG, [5], 2**31)


async def test_status_only_bodies_are_refusals_with_their_text(double):
    client = DynologClient("127.0.0.1", double.port)
    with pytest.raises(DynologRefused) as err:
        await client.call({"fn": "setKinetOnDemandRequest", "config": CONFIG})  # no pids: {"status":"failed"}
    assert err.value.reason == "dynolog_error" and err.value.metric_reason == "dynolog_refused"
    assert "refused 'setKinetOnDemandRequest': failed" in err.value.detail
    with pytest.raises(DynologRefused) as err:
        await client.call({"fn": "setKinetOnDemandRequest", "config": CONFIG, "pids": "100", "job_id": 7})
    assert "failed with exception" in err.value.detail
    with pytest.raises(DynologRefused):
        await client.call({"fn": "dcgmProfPause"})
    # a status that is a value (getStatus's int, dcgm's bool) is an answer, not a refusal
    assert await client.call({"fn": "dcgmProfResume"}) == {"status": False}
    assert await client.call({"fn": "getStatus"}) == {"status": 1}
    with pytest.raises(TriggerFailed) as err:  # the result parser refuses the same shape on its own
        OnDemandResult.from_body({"status": "failed"})
    assert err.value.reason == "dynolog_error" and "failed" in err.value.detail


async def test_a_refusal_is_counted_as_an_rpc_error_not_a_success(double):
    """The agent's RPC counter (AgentMetrics.dynolog_call as on_call, as the agent wires it) against
    the double: answered calls count no error, a failure document counts as `dynolog_refused`."""
    metrics = AgentMetrics()
    client = DynologClient("127.0.0.1", double.port, on_call=metrics.dynolog_call)
    assert (await client.set_kineto_ondemand_request(CONFIG, [4242], 7)).processes_matched == ()  # answered
    assert await client.get_version() == "0.6.0"
    assert errors(metrics) == {}
    with pytest.raises(DynologRefused):
        await client.call({"fn": "setKinetOnDemandRequest", "config": CONFIG, "pids": "4242", "job_id": 7})
    assert errors(metrics) == {("setKinetOnDemandRequest", "dynolog_refused"): 1}
    assert calls(metrics) == {"setKinetOnDemandRequest": 2, "getVersion": 1}  # every call timed


async def test_an_answer_the_client_cannot_use_is_counted_as_dynolog_error():
    """A broken server that frames a JSON object of the wrong shape for every request."""
    async def wrong_shape(reader, writer):
        await reader.read(1 << 16)
        writer.write(encode_frame({"hello": 1}))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(wrong_shape, "127.0.0.1", 0)
    metrics = AgentMetrics()
    try:
        client = DynologClient("127.0.0.1", server.sockets[0].getsockname()[1], timeout_s=2,
                               on_call=metrics.dynolog_call)
        for call in (client.get_version(), client.get_status(), client.set_kineto_ondemand_request(CONFIG, [5], 7)):
            with pytest.raises(TriggerFailed) as err:
                await call
            assert err.value.reason == err.value.metric_reason == "dynolog_error"
    finally:
        server.close()
        await server.wait_closed()
    assert errors(metrics) == {(m, "dynolog_error"): 1 for m in ("getVersion", "getStatus", "setKinetOnDemandRequest")}


def errors(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    """The error counter's non-zero samples, read from the exposition /metrics serves."""
    return {(s.labels["method"], s.labels["reason"]): s.value for f in text_string_to_metric_families(
        metrics.exposition().decode()) for s in f.samples if s.name == "gpulens_agent_dynolog_rpc_errors_total"
        and s.value}


def calls(metrics: AgentMetrics) -> dict[str, float]:
    return {s.labels["method"]: s.value for f in text_string_to_metric_families(metrics.exposition().decode())
            for s in f.samples if s.name == "gpulens_agent_dynolog_rpc_duration_seconds_count"}


async def test_unknown_function_gets_eof_and_a_clear_error(double):
    client = DynologClient("127.0.0.1", double.port)
    with pytest.raises(TriggerFailed) as err:
        await client.call({"fn": "setKinetoOnDemandRequest"})  # the "o" dynolog does not have
    assert err.value.reason == "dynolog_error" and "closed without answering" in err.value.detail
    # malformed frames get no answer from dynolog either
    assert await raw_call(double.port, struct.pack("<i", 0)) == b""
    assert await raw_call(double.port, encode_frame({"no_fn": 1})) == b""
    assert await raw_call(double.port, struct.pack("<i", 5) + b"[1,2]") == b""


async def test_dynolog_not_listening_fails_fast_and_retryable():
    client = DynologClient("127.0.0.1", free_port(), timeout_s=2)
    with pytest.raises(TriggerFailed) as err:
        await client.set_kineto_ondemand_request(CONFIG, [5], 7)
    assert err.value.reason == "dynolog_unreachable" and err.value.retryable
    assert "not listening" in err.value.detail


async def test_a_server_that_accepts_and_never_answers_does_not_hang_the_client():
    accepted = []

    async def silent(reader, writer):
        accepted.append(writer)
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = DynologClient("127.0.0.1", port, timeout_s=0.5)
        with pytest.raises(TriggerFailed) as err:
            await client.get_version()
        assert err.value.reason == "dynolog_unreachable" and "did not answer" in err.value.detail
        assert accepted  # it did connect: the timeout is on the read, not the connect
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def test_garbage_length_prefix_is_an_error_not_a_giant_read():
    async def liar(reader, writer):
        await reader.read(1 << 16)
        writer.write(struct.pack("<i", -7) + b"{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(liar, "127.0.0.1", 0)
    try:
        client = DynologClient("127.0.0.1", server.sockets[0].getsockname()[1], timeout_s=2)
        with pytest.raises(TriggerFailed) as err:
            await client.get_version()
        assert "bad length prefix" in err.value.detail
    finally:
        server.close()
        await server.wait_closed()


async def test_the_double_forgets_silent_processes(sock_dir, poller_factory):
    async with DynologDouble(socket_dir=sock_dir, keepalive_s=0.2, gc_interval_s=0.1) as d:
        client = DynologClient("127.0.0.1", d.port)
        await poller_factory(sock_dir, 7, [100]).apoll()
        assert (await client.set_kineto_ondemand_request(CONFIG, [100], 7)).outcome_for(100) is PidOutcome.QUEUED
        for _ in range(50):
            if not d.registry():
                break
            await asyncio.sleep(0.1)
        assert d.registry() == []
        assert (await client.set_kineto_ondemand_request(CONFIG, [100], 7)).outcome_for(100) is PidOutcome.NOT_MATCHED


def test_the_double_runs_as_a_process(sock_dir):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tests.doubles.dynolog_double", "--port", "0", "--socket-dir", sock_dir],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["ipc"].endswith("/dynolog")
        s = socket.create_connection(("127.0.0.1", ready["rpc_port"]), timeout=5)
        s.sendall(encode_frame({"fn": "getVersion"}))
        data = s.recv(100)
        assert data[4:] == b'{"version":"0.6.0"}'
        s.close()
    finally:
        proc.terminate()
        proc.wait(10)
