"""Run inside a fresh network namespace (`unshare --net`): does a real Kineto read its configs on
time after the builtin endpoint stalled? Prints one JSON line.

    unshare --net python stall_probe.py OUT_DIR [--without-catch-up]

One plain trainer (torch 2.13, KINETO_USE_DAEMON) polls the endpoint on the abstract socket. Right
after one of its polls the endpoint stalls, as an agent stopped by SIGSTOP or starved of CPU does:
its queue is filled (10 datagrams, `net.unix.max_dgram_qlen`) and its event loop blocked. Kineto's
next poll, 5 s later, finds the queue full; its sync_send retries with doubling sleeps and tries for
the tenth time 10.23 s later. The stall ends 7.6 s into those retries (the middle of the 5.12 s
before the tenth), so the tenth try goes through, and Kineto, which counts it as a failure ("IPC
sync_send fail"), does not read its answer. Then a wall-clock config is handed over; the probe
reports the gap between the endpoint's handover and Kineto's "Received config from dyno" line:
milliseconds when Kineto reads its answers on time, one poll (5 s) when it reads them a poll behind.
`--without-catch-up` switches the endpoint's rule off (ipc_server.SILENCE_S), to show the gap
without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpulens.capture.dynolog import KinetoEndpoint, TraceConfig, build_config, ipc_server, tick_aligned_start_ms  # noqa: E402
from tests.agent.probe_trainer import start_trainer, stop_trainer  # noqa: E402

JOB = 79
POLL_S = 5.0                       # Kineto's on-demand poll interval (default)
INTO_RETRIES_S = 7.6               # the stall ends this far into the retries: after the ninth (5.11 s), before the tenth (10.23 s)
SEND_FAILED = "IPC sync_send fail"
RECEIVED = "Received config from dyno"


async def _until(what: str, check, timeout: float, lines: list):
    end = time.time() + timeout
    while not (got := check()):
        assert time.time() < end, f"{what}; Kineto said {[t for _, t in lines][-6:]}"
        await asyncio.sleep(0.01)
    return got


async def main(out: Path, catch_up: bool) -> dict:
    if not catch_up:
        ipc_server.SILENCE_S = math.inf
    deliveries = []
    ep = KinetoEndpoint(None, on_delivered=deliveries.append)
    await ep.start()
    stop = out / "stop"
    lines: list = []
    trainer = start_trainer(JOB, stop, 120, kineto_lines=lines)

    def proc():
        return next((p for p in ep.processes() if p.job_id == JOB and p.leaf == trainer.pid), None)
    try:
        await _until("the trainer never polled the abstract socket", proc, 60, lines)
        seen = proc().last_seen
        await _until("no second poll", lambda: proc().last_seen != seen, 2 * POLL_S + 1, lines)
        polled, polls = time.time(), proc().polls
        junk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        junk.setblocking(False)
        queued = 0
        try:
            while True:
                junk.sendto(b"stall", ep.address)
                queued += 1
        except BlockingIOError:
            pass
        # the stall: this blocks the event loop the endpoint answers on, as a stopped agent's is
        time.sleep(max(0.0, polled + POLL_S + INTO_RETRIES_S - time.time()))
        stalled_until = time.time()
        await _until("Kineto never reported its send failed",
                     lambda: any(SEND_FAILED in t for at, t in lines if at > stalled_until), 10, lines)
        # the tenth try and the poll that follows it at once, both in before the config is handed over
        await _until("no two polls after the stall", lambda: proc().polls >= polls + 2, 2, lines)
        start_ms = tick_aligned_start_ms(time.time() + 16, 0)
        log_file = str(out / "c0" / "rank-0.json")
        (out / "c0").mkdir()
        triggered = time.time()
        ep.trigger(build_config(TraceConfig(log_file, 500, ("cpu_op",), start_time_ms=start_ms)), [trainer.pid], JOB,
                   trace_id="700")
        delivery = await _until("the config was never fetched", lambda: deliveries[:1], 3 * POLL_S, lines)
        received = await _until("Kineto never logged the config's arrival",
                                lambda: [at for at, t in lines if at > triggered and RECEIVED in t][:1], 3 * POLL_S, lines)
        failed = sum(1 for at, t in lines if at > stalled_until and SEND_FAILED in t)
        return {"queue_filled_with": queued, "send_failed_lines": failed, "late_unanswered": ep.late_unanswered,
                "unread_answers": ep.unread_answers, "gap_s": round(received[0] - delivery[0].at, 3)}
    finally:
        stop_trainer(trainer, stop)
        await ep.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), "--without-catch-up" not in sys.argv[2:]))), flush=True)
