"""The builtin trigger: the agent's own answer to Kineto's IPC polls, byte for byte."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
import uuid

import pytest

from gpulens.capture.dynolog import EndpointBusy, KinetoEndpoint, PidOutcome, ipc_server
from gpulens.capture.dynolog.ipcwire import endpoint_address

from tests.agent.conftest import KINETO_ANSWER_WAIT_S

CONFIG = "ACTIVITIES_LOG_FILE=/t/c/rank-0.json\nACTIVITIES_DURATION_MSECS=500"


def test_addresses_follow_kineto():
    # abstract: NUL + name + trailing NUL; Kineto's address length (2 + 9 = 11) covers both NULs
    assert endpoint_address() == b"\0dynolog\0" and len(endpoint_address()) == 9
    assert endpoint_address(socket_dir="/run/gl") == "/run/gl/dynolog"


@pytest.fixture
async def endpoint(sock_dir):
    deliveries = []
    ep = KinetoEndpoint(sock_dir, on_delivered=deliveries.append)
    await ep.start()
    ep.deliveries = deliveries
    yield ep
    await ep.stop()


async def test_register_trigger_fetch_in_socket_dir_mode(endpoint, sock_dir, poller_factory):
    assert os.stat(os.path.join(sock_dir, "dynolog")).st_mode & 0o777 == 0o666
    worker = poller_factory(sock_dir, 7, [100, 50, 1])
    assert await worker.apoll() == ""  # registered, nothing pending: an empty 40-byte answer
    result = endpoint.trigger(CONFIG, [100], 7, trace_id="4242")
    assert result.outcome_for(100) is PidOutcome.QUEUED
    assert endpoint.deliveries == []  # queued is not delivered
    got = await worker.apoll()
    assert got == "\n    " + CONFIG + "\n    REQUEST_TRACE_ID=4242\n"
    assert [(d.job_id, d.pid, d.trace_id) for d in endpoint.deliveries] == [(7, 100, "4242")]
    assert await worker.apoll() == ""  # handed over once


async def test_abstract_mode_with_the_trailing_nul(poller_factory):
    name = f"dynolog-test-{uuid.uuid4().hex[:8]}"  # the machine's @dynolog may belong to someone else
    ep = KinetoEndpoint(None, name=name)
    await ep.start()
    try:
        addr = b"\0" + name.encode() + b"\0"
        worker = poller_factory(None, 7, [100], server=addr)
        assert await worker.apoll() == ""
        ep.trigger(CONFIG, [100], 7)
        assert CONFIG in await worker.apoll()
        # without the trailing NUL it is another name: nobody listens there
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with pytest.raises(ConnectionRefusedError):
            s.sendto(b"x" * 40, b"\0" + name.encode())
        s.close()
    finally:
        await ep.stop()


async def test_matches_the_leaf_pid_only_and_the_job(endpoint, sock_dir, poller_factory):
    worker = poller_factory(sock_dir, 7, [100, 50, 1])
    child = poller_factory(sock_dir, 7, [200, 100, 50, 1])  # inherited the job id, lists 100 as ancestor
    other_pod = poller_factory(sock_dir, 8, [100, 60, 1])   # same pid in another pod: another job id
    for p in (worker, child, other_pod):
        await p.apoll()
    result = endpoint.trigger(CONFIG, [100], 7, trace_id="1")
    assert result.processes_matched == (100,) and result.activity_triggered == (100,)
    assert await child.apoll() == "" and await other_pod.apoll() == ""
    assert CONFIG in await worker.apoll()


async def test_busy_while_tracing_and_until_fetched(endpoint, sock_dir, poller_factory):
    worker = poller_factory(sock_dir, 7, [100])
    await worker.apoll()
    assert endpoint.trigger(CONFIG, [100], 7, trace_id="1").outcome_for(100) is PidOutcome.QUEUED
    second = endpoint.trigger(CONFIG.replace("rank-0", "rank-9"), [100], 7, trace_id="2")
    assert second.outcome_for(100) is PidOutcome.WAITING_FOR_SLOT and second.activity_busy == 1
    assert await worker.apoll(config_type=1) == ""  # tracing: activities bit clear, nothing handed over
    got = await worker.apoll()
    assert "rank-0" in got and "REQUEST_TRACE_ID=1" in got and "rank-9" not in got
    assert endpoint.trigger(CONFIG, [100], 7).outcome_for(100) is PidOutcome.QUEUED
    assert endpoint.trigger(CONFIG, [999], 7).outcome_for(999) is PidOutcome.NOT_MATCHED


async def test_a_config_made_moot_by_its_trace_is_dropped_at_the_handover_not_before(endpoint, sock_dir, poller_factory,
                                                                                     tmp_path):
    worker = poller_factory(sock_dir, 7, [100])
    await worker.apoll()
    trace = tmp_path / "rank-0_100.json"
    assert endpoint.trigger(CONFIG, [100], 7, trace_id="5", moot_if=str(trace)).outcome_for(100) is PidOutcome.QUEUED
    assert await worker.apoll(config_type=1) == ""     # busy: the earlier copy is being traced
    trace.write_text("{}")                                # ... and lands, then Kineto polls idle
    assert await worker.apoll() == ""
    assert endpoint.deliveries == [] and not any(p.pending for p in endpoint.processes())
    # without its trace there, the same copy is handed over as any config
    assert endpoint.trigger(CONFIG, [100], 7, trace_id="6", moot_if=str(tmp_path / "absent.json")) \
        .outcome_for(100) is PidOutcome.QUEUED
    assert "REQUEST_TRACE_ID=6" in await worker.apoll()
    assert [d.trace_id for d in endpoint.deliveries] == ["6"]


async def test_malformed_datagrams_get_no_answer_and_do_not_break_it(endpoint, sock_dir, poller_factory):
    p = poller_factory(sock_dir, 7, [100])
    header = struct.Struct("<Q32s")
    assert await asyncio.to_thread(p.raw_quiet, b"short") is None
    assert await asyncio.to_thread(p.raw_quiet, header.pack(99, b"req") + b"\0" * 16) is None      # size lies
    assert await asyncio.to_thread(p.raw_quiet, header.pack(16, b"req") + struct.pack("<iiq", 3, 0, 7)) is None  # n = 0
    assert await asyncio.to_thread(p.raw_quiet, header.pack(4, b"hello") + b"abcd") is None         # unknown type
    ctxt = await asyncio.to_thread(p.raw, header.pack(16, b"ctxt") + struct.pack("<iiq", 0, 100, 7))
    assert ctxt[40:] == struct.pack("<i", 1)
    assert await p.apoll() == ""  # still serving


async def test_polls_kineto_gave_up_on_get_no_answer_so_later_answers_are_not_behind(endpoint, sock_dir, poller_factory):
    """The endpoint stalls (its loop blocked: a stopped or starved agent) while a trainer polls
    three times; Kineto waits 50 ms for each answer, then gives up. Answering those polls would
    queue three stale answers in Kineto's socket, which reads one datagram per poll: the config
    triggered next would reach it three polls (15 s) late, and the agent would call it refused.
    So: no answer to a poll that waited past the window, the config is handed over on the first
    poll that still waits for it, and nothing is left queued."""
    worker = poller_factory(sock_dir, 7, [100])
    assert await worker.apoll() == ""                        # registered
    for _ in range(3):
        worker.send_poll()
    time.sleep(0.2)                                          # the stall itself (the loop is blocked)
    stalled_until = time.monotonic()
    # the loop runs again and reads the three polls (each refreshes the process)
    deadline = stalled_until + 5
    while not (endpoint.processes() and endpoint.processes()[0].last_seen >= stalled_until) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert [p.leaf for p in endpoint.processes()] == [100]   # still known: a late poll is a sign of life
    assert worker.queued_answers() == 0                      # none of the three was answered
    endpoint.trigger(CONFIG, [100], 7, trace_id="77")
    got = await asyncio.to_thread(worker.poll, 3, KINETO_ANSWER_WAIT_S)    # Kineto's own wait
    assert got is not None and "REQUEST_TRACE_ID=77" in got
    assert [d.trace_id for d in endpoint.deliveries] == ["77"]
    assert worker.queued_answers() == 0
    assert endpoint.late_unanswered == 3


async def test_the_answer_does_not_wait_for_the_agents_slow_bookkeeping(sock_dir, poller_factory):
    """The agent records each handed-over config and each thing Kineto's polls said by writing the
    target's status (on_delivered, on_kineto): on a busy node such a write can take longer than the
    ~50 ms Kineto waits for its answer. The answer must go out first: held up, it would reach Kineto's
    next poll 5 s later, the config with it, too late to warm up (seen: a warm-up refusal on the
    two-node cluster's rank 3, after its agent resumed)."""
    deliveries, outcomes = [], []

    def slow_write(into):
        def record(x):
            time.sleep(0.3)               # a status write stuck behind a busy disk
            into.append(x)
        return record
    ep = KinetoEndpoint(sock_dir, on_delivered=slow_write(deliveries), on_kineto=slow_write(outcomes))
    await ep.start()
    try:
        worker = poller_factory(sock_dir, 7, [100])
        assert await worker.apoll() == ""                    # registered
        ep.trigger(CONFIG, [100], 7, trace_id="88")
        got = await asyncio.to_thread(worker.poll, 3, KINETO_ANSWER_WAIT_S)    # Kineto's own wait
        assert got is not None and "REQUEST_TRACE_ID=88" in got, "the answer waited for the status write"
        deadline = time.monotonic() + 5
        while not deliveries and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [d.trace_id for d in deliveries] == ["88"]    # still recorded, after the answer
        # a poll whose news (Kineto went busy: the trace started) the agent records: answered in time too
        got = await asyncio.to_thread(worker.poll, 0, KINETO_ANSWER_WAIT_S)
        assert got == "", "the answer waited for the status write"
        while not outcomes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [o.kind for o in outcomes] == ["started"]
        assert worker.queued_answers() == 0
    finally:
        await ep.stop()


async def test_peers_outside_the_socket_dir_are_never_answered(endpoint, sock_dir, poller_factory, tmp_path):
    """Kineto terminates the trainer if the answer's sender path is not under its own socket dir;
    a trainer that reached us under another folder name must get silence, not an answer."""
    other = os.path.join("/tmp", f"gl-{uuid.uuid4().hex[:6]}")
    os.mkdir(other)
    try:
        stranger = poller_factory(other, 7, [100], server=os.path.join(sock_dir, "dynolog"))
        assert await asyncio.to_thread(stranger.poll, 3, 0.5) is None
        assert endpoint.processes() == []
    finally:
        stranger.close()
        os.rmdir(other)


async def test_silent_processes_are_forgotten(sock_dir, poller_factory):
    ep = KinetoEndpoint(sock_dir, keepalive_s=0.2, gc_interval_s=0.1)
    await ep.start()
    try:
        await poller_factory(sock_dir, 7, [100]).apoll()
        assert len(ep.processes()) == 1
        for _ in range(50):
            if not ep.processes():
                break
            await asyncio.sleep(0.1)
        assert ep.processes() == []
        assert ep.trigger(CONFIG, [100], 7).outcome_for(100) is PidOutcome.NOT_MATCHED
    finally:
        await ep.stop()


async def test_never_steals_a_live_endpoint_but_replaces_a_stale_file(sock_dir):
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = os.path.join(sock_dir, "dynolog")
    live.bind(path)  # say, a dynolog daemon
    try:
        with pytest.raises(EndpointBusy):
            await KinetoEndpoint(sock_dir).start()
        assert os.path.exists(path)
    finally:
        live.close()
    # the daemon is gone, its socket file stays: that one is ours to replace
    ep = KinetoEndpoint(sock_dir)
    await ep.start()
    await ep.stop()
    assert not os.path.exists(path)


async def test_an_answer_held_up_past_the_window_is_not_sent_and_its_config_goes_back(sock_dir, poller_factory):
    """The poll was fresh when read, but the agent was stopped (the two-node test's SIGSTOP) or
    descheduled before it answered: sent now, the answer would reach Kineto after it stopped waiting
    and be read as its next poll's, every later answer a poll behind (seen in the two-node cluster:
    the config reached rank 3 one poll, 5 s, late and was cancelled for warm-up). So the age is checked
    again at the send: no answer, the config is pending again, nobody is told it was fetched, and the
    next poll gets it."""
    deliveries = []
    ep = KinetoEndpoint(sock_dir, on_delivered=deliveries.append)
    await ep.start()
    try:
        worker = poller_factory(sock_dir, 7, [100])
        assert await worker.apoll() == ""                    # registered
        ep.trigger(CONFIG, [100], 7, trace_id="99")
        handle = ep._handle

        def held_up(datagram, **kw):                         # stands for the stop between read and send
            reply = handle(datagram, **kw)
            time.sleep(0.2)
            return reply
        ep._handle = held_up
        worker.send_poll()
        deadline = time.monotonic() + 5
        while ep.late_unanswered < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ep.late_unanswered == 1 and worker.queued_answers() == 0   # no stale answer queued for Kineto
        assert deliveries == [] and [p.pending_trace_id for p in ep.processes()] == ["99"]
        ep._handle = handle
        got = await asyncio.to_thread(worker.poll, 3, KINETO_ANSWER_WAIT_S)    # Kineto's own wait
        assert got is not None and "REQUEST_TRACE_ID=99" in got
        deadline = time.monotonic() + 5
        while not deliveries and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [d.trace_id for d in deliveries] == ["99"] and worker.queued_answers() == 0
    finally:
        await ep.stop()


async def test_an_answer_kineto_never_waited_for_is_what_its_next_poll_reads(sock_dir, poller_factory, monkeypatch):
    """After a silence (a stalled endpoint whose full queue kept Kineto's sync_send retrying), Kineto's
    tenth try goes through but is reported failed, so its answer (here: the config) is never read, and
    Kineto polls again at once. That poll is left unanswered: Kineto reads the missed answer now, and
    nothing stays queued to put every later answer a poll behind (tests/agent/test_stall_torch.py shows
    it with real Kineto). The silence is scaled down from 5 s; the rule is the same."""
    monkeypatch.setattr(ipc_server, "SILENCE_S", 0.3)
    deliveries = []
    ep = KinetoEndpoint(sock_dir, on_delivered=deliveries.append)
    await ep.start()
    try:
        worker = poller_factory(sock_dir, 7, [100])
        assert await worker.apoll() == ""                    # registered
        await asyncio.sleep(0.35)                            # the silence (the input, not a wait on a condition)
        ep.trigger(CONFIG, [100], 7, trace_id="98")
        worker.send_poll()                                   # the tenth try: answered, never read
        got = await asyncio.to_thread(worker.poll, 3, KINETO_ANSWER_WAIT_S)   # the poll at once after it
        assert got is not None and "REQUEST_TRACE_ID=98" in got
        assert worker.queued_answers() == 0 and ep.unread_answers == 1
        assert await worker.apoll() == "" and worker.queued_answers() == 0    # answered again, once caught up
        assert ep.unread_answers == 1 and [d.trace_id for d in deliveries] == ["98"]
    finally:
        await ep.stop()


async def test_a_process_polling_fast_without_a_silence_gets_every_answer(endpoint, sock_dir, poller_factory):
    """Fast polls alone (a stand-in polling every 100 ms, or Kineto's poll after an answer it read)
    are no sign of an unread answer: each is answered."""
    worker = poller_factory(sock_dir, 7, [100])
    got = [await worker.apoll() for _ in range(5)]
    assert got == [""] * 5 and worker.queued_answers() == 0 and endpoint.unread_answers == 0


async def test_processes_whose_polls_wait_in_the_queue_are_not_forgotten_and_still_caught_up(sock_dir, poller_factory, monkeypatch):
    """After a stall the garbage collector may run before the socket's reader (seen in the two-node
    test: `ipc.forgot_processes` at the instant the agent resumed, then the queued polls). It reads
    the queue first, so a process whose polls waited there is kept, with the silence before its next
    poll, and the catch-up rule still applies: nothing stays queued at Kineto."""
    monkeypatch.setattr(ipc_server, "SILENCE_S", 0.3)
    ep = KinetoEndpoint(sock_dir, keepalive_s=0.3, gc_interval_s=3600)
    await ep.start()
    try:
        worker = poller_factory(sock_dir, 7, [100])
        assert await worker.apoll() == ""                    # registered
        worker.send_poll()                                   # queued while the endpoint is stalled:
        time.sleep(0.5)                                      # this blocks the loop it reads on
        assert ep.collect_garbage() == 0 and [p.leaf for p in ep.processes()] == [100]
        assert ep.late_unanswered == 1
        worker.send_poll()                                   # the tenth try: answered, never read
        got = await asyncio.to_thread(worker.poll, 3, KINETO_ANSWER_WAIT_S)
        assert got == "" and worker.queued_answers() == 0 and ep.unread_answers == 1
    finally:
        await ep.stop()
