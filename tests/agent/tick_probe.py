"""Run inside a fresh network namespace (`unshare --net`): how much room Kineto's profiler tick
leaves a time-based config, with real torch. Prints one JSON line.

    unshare --net python tick_probe.py OUT_DIR

One plain trainer (it never steps Kineto) polls the builtin endpoint on the abstract socket. Four
wall-clock configs go to it one after another, each 13 s ahead, as the coordinator places them
(`tick_aligned_start_ms` on the phase where the last window ended): a 1 s window on a whole second,
a 1.5 s window on a whole second (its end falls between two ticks), a 1 s window on the half second
where that one ended, and last a 1 s window on a whole second again, off the phase the third left
(the placement a rule of whole seconds alone would choose). For each, the room is (start - 5 s
warm-up) - the moment Kineto logged that its tick activated the config ("Received on-demand activity
trace request"): Kineto cancels the config when the room is negative. The trainer's stderr is read
line by line and each line stamped as it arrives.

A config Kineto fetched later than its start - warm-up - 1 s (one tick) says nothing of the grid:
its room is wherever the fetch fell. That happened once in a CI run (four lanes on 2 cores: the
first config fetched 10 s after it was queued, refused with 2.8 s to warm up); such a config is
queued again with a new start, up to twice, and reported (`late`, with the trainer's poll times
as the endpoint saw them). A config fetched in time and refused fails the probe.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpulens.capture.dynolog import (
    KinetoEndpoint,
    TraceConfig,
    build_config,
    kineto_trace_path,
    tick_aligned_start_ms,
)
from tests.agent.probe_trainer import start_trainer, stop_trainer  # noqa: E402

JOB = 78
WARMUP_S = 5.0             # Kineto's ACTIVITIES_WARMUP_PERIOD_SECS default
ACTIVATED = "Received on-demand activity trace request"


async def main(out: Path) -> dict:
    fetched: dict[str, float] = {}
    ep = KinetoEndpoint(None, on_delivered=lambda d: fetched.setdefault(d.trace_id, d.at))
    await ep.start()
    stop = out / "stop"
    lines: list = []
    trainer = start_trainer(JOB, stop, 150, kineto_lines=lines)
    rooms, files, late = [], [], []
    polls: set[float] = set()          # when the trainer's polls reached the endpoint (wall clock)

    def note_polls() -> None:
        polls.update(round(p.polled_at, 2) for p in ep.processes() if p.job_id == JOB and p.polled_at is not None)
    try:
        end = time.time() + 60
        while not any(p.job_id == JOB and p.leaf == trainer.pid for p in ep.processes()):
            assert time.time() < end, "the trainer never polled the abstract socket"
            await asyncio.sleep(0.2)
        phase = 0
        for i, (duration_ms, on_phase) in enumerate(((1000, True), (1500, True), (1000, True), (1000, False))):
            for attempt in range(3):
                start_ms = tick_aligned_start_ms(time.time() + 13, phase if on_phase else 0)
                log_file = str(out / f"c{i}-{attempt}" / "rank-0.json")
                (out / f"c{i}-{attempt}").mkdir()
                seen, queued, trace_id = len(lines), time.time(), str(400 + 10 * attempt + i)
                ep.trigger(build_config(TraceConfig(log_file, duration_ms, ("cpu_op",), start_time_ms=start_ms)),
                           [trainer.pid], JOB, trace_id=trace_id)
                final = Path(kineto_trace_path(log_file, trainer.pid))
                deadline = start_ms / 1000 + 30
                while not final.exists() and time.time() < deadline \
                        and not any("Not starting tracing" in t for _, t in lines[seen:]):
                    note_polls()
                    await asyncio.sleep(0.2)
                if final.exists():
                    break
                at = fetched.get(trace_id)
                why = (f"config {i}: no trace; queued {queued:.2f}, start {start_ms / 1000:.2f}, fetched "
                       f"{at and round(at, 2)}, polls {sorted(p for p in polls if p >= queued - 6)}; "
                       f"unanswered late {ep.late_unanswered}, left to read {ep.unread_answers}; "
                       f"Kineto said {[t for _, t in lines[seen:]][-5:]}")
                assert at is not None and at > start_ms / 1000 - WARMUP_S - 1.0, why   # never, or in time: a failure
                late.append(why)
            else:
                raise AssertionError(f"config {i}: fetched too late three times: {late}")
            phase = (start_ms + duration_ms) % 1000
            [at] = [t for t, text in lines[seen:] if ACTIVATED in text][:1] or [None]
            assert at is not None, f"config {i}: Kineto never logged {ACTIVATED!r}: {[t for _, t in lines[seen:]][-5:]}"
            rooms.append(round(start_ms / 1000 - WARMUP_S - at, 3))
            files.append(final.stat().st_size > 0)
    finally:
        stop_trainer(trainer, stop)
        await ep.stop()
    return {"rooms": rooms, "traced": files, "late": late}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))), flush=True)
