"""Run inside a fresh network namespace (`unshare --net`): the builtin endpoint on the abstract
`@dynolog\\0` socket, one real torch trainer without KINETO_IPC_SOCKET_DIR, one trace.

Abstract sockets are per network namespace, so a private namespace keeps this test from meeting
any other `@dynolog` on the machine. Prints one JSON line with what happened.

    unshare --net python abstract_probe.py OUT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpulens.capture.dynolog import KinetoEndpoint, PidOutcome, TraceConfig, build_config, kineto_trace_path  # noqa: E402
from tests.agent.probe_trainer import start_trainer, stop_trainer  # noqa: E402

JOB = 77


async def main(out: Path) -> dict:
    delivered = []
    ep = KinetoEndpoint(None, on_delivered=delivered.append)  # abstract @dynolog\0
    await ep.start()
    stop = out / "stop"
    trainer = start_trainer(JOB, stop, 120)
    result: dict = {"address": ep.describe()}
    try:
        end = time.time() + 60
        while not any(p.job_id == JOB and p.leaf == trainer.pid for p in ep.processes()):
            assert time.time() < end, "the trainer never polled the abstract socket"
            await asyncio.sleep(0.2)
        log_file = str(out / "abstract" / "rank-0.json")
        (out / "abstract").mkdir()
        answer = ep.trigger(build_config(TraceConfig(log_file, 500, ("cpu_op",))), [trainer.pid], JOB, trace_id="31337")
        result["outcome"] = answer.outcome_for(trainer.pid).value
        final = Path(kineto_trace_path(log_file, trainer.pid))
        while answer.outcome_for(trainer.pid) is PidOutcome.QUEUED and not final.exists():
            assert time.time() < end + 30, "no trace file"
            await asyncio.sleep(0.2)
        doc = json.loads(final.read_text())
        result.update(file=str(final), trace_id=doc.get("trace_id"), delivered=[d.pid for d in delivered],
                      pid=trainer.pid, cats=sorted({e.get("cat") for e in doc["traceEvents"] if e.get("cat")}))
    finally:
        stop_trainer(trainer, stop)
        await ep.stop()
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))), flush=True)
