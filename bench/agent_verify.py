"""Node agent benchmarks: verification throughput, and observation latency under a big verification.

1. Throughput: the agent's streaming verifier (`verify_trace`: parse, check, sha256) next to a
   plain `json.load` of the same Kineto-shaped file and to ijson's C backend (yajl2_c) doing the
   same per-event checks and hashing, each in a fresh process (so peak RSS is the
   variant's own), interleaved, medians.
2. Observation latency: small trace files renamed into a watched folder, time until the agent's
   observer reports them, (a) idle, (b) while a ~1 GB file verifies in the agent's process pool,
   and (c) for contrast, while the same verification runs on the event loop thread (what the
   design forbids). Medians over the small files.

    python bench/agent_verify.py [--size-mb 200] [--big-mb 1024] [--runs 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from capture.agent.observation import Observer  # noqa: E402
from capture.agent.verification import Expectation, verify_trace  # noqa: E402

PID = 4242


def make_trace(path: Path, size_mb: int) -> None:
    """A Kineto-shaped CPU trace (keys, event shapes and units as torch 2.13 writes them)."""
    start = time.time()
    base_ns = int(start) * 10**9
    t0 = (start - int(start)) * 1e6
    target = size_mb << 20
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "deviceProperties": [], "trace_id": "1", "host_name": "bench", '
                f'"displayTimeUnit": "ms", "baseTimeNanoseconds": {base_ns}, "traceEvents": [\n')
        n, written, chunk = 0, 0, []
        while written < target:
            ts = t0 + (n % 400_000) * 1.5
            line = (f'{{"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": {PID}, "tid": {PID}, '
                    f'"ts": {ts:.3f}, "dur": 1.250, "args": {{"External id": {n}, "Record function id": 0, '
                    f'"Sequence number": {n}, "Fwd thread id": 0, "Ev Idx": {n}}}}},\n')
            chunk.append(line)
            written += len(line)
            n += 1
            if len(chunk) == 10_000:
                f.write("".join(chunk))
                chunk = []
        f.write("".join(chunk))
        f.write(f'{{"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": {t0 + 600_000}}}\n')
        f.write(f'], "traceName": {json.dumps(str(path))}}}')


def expectation() -> Expectation:
    now = time.time()
    return Expectation(("cpu_op",), window_start=now - 3600, window_end=now + 3600, duration_ms=600_000, pid=PID,
                       span_slack_ms=10**9)


# --- 1. throughput -----------------------------------------------------------------------------

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
path, how = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if how == "json.load":
    with open(path) as f:
        doc = json.load(f)
    ok = isinstance(doc, dict)
elif how == "ijson":
    # ijson's C backend (yajl2_c) doing the same per-event work as verify_trace (events only: it
    # has no cheap way to hand back the top-level keys, so this is an upper bound for it)
    import hashlib, ijson
    from bench.agent_verify import PID
    assert ijson.backend == "yajl2_c", ijson.backend
    sha, cats = hashlib.sha256(), {}
    class Hashing:
        def __init__(self, f):
            self.f = f
        def read(self, n):
            d = self.f.read(n)
            sha.update(d)
            return d
    ts_min = ts_max = None
    foreign = 0
    with open(path, "rb") as f:
        for item in ijson.items(Hashing(f), "traceEvents.item", use_float=True, buf_size=1 << 20):
            if not isinstance(item, dict):
                continue
            cat = item.get("cat")
            if cat is not None:
                cats[cat] = cats.get(cat, 0) + 1
            ph, ts = item.get("ph"), item.get("ts")
            if ph != "M" and isinstance(ts, (int, float)) and not isinstance(ts, bool):
                dur = item.get("dur")
                end = ts + dur if isinstance(dur, (int, float)) and not isinstance(dur, bool) else ts
                ts_min = ts if ts_min is None or ts < ts_min else ts_min
                ts_max = end if ts_max is None or end > ts_max else ts_max
            if cat == "cpu_op" and item.get("pid") != PID:
                foreign += 1
    ok = foreign == 0 and cats.get("cpu_op", 0) > 0
else:
    from bench.agent_verify import expectation
    from capture.agent.verification import verify_trace
    ok = verify_trace(path, expectation()).ok
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "ok": ok, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def throughput(path: Path, runs: int) -> dict[str, dict[str, float]]:
    repo = str(Path(__file__).resolve().parent.parent)
    results: dict[str, list[dict]] = {"json.load": [], "verify_trace": [], "ijson": []}
    for _ in range(runs):
        for how in results:
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), how, repo], capture_output=True, text=True,
                                 check=True)
            results[how].append(json.loads(out.stdout))
    mb = path.stat().st_size / 2**20
    return {how: {"mb_s": mb / statistics.median(r["s"] for r in rs), "s": statistics.median(r["s"] for r in rs),
                  "rss_mb": statistics.median(r["rss_mb"] for r in rs), "ok": all(r["ok"] for r in rs)}
            for how, rs in results.items()}


# --- 2. observation latency --------------------------------------------------------------------

async def latencies(watch: Path, n: int, gap_s: float, observer: Observer) -> list[float]:
    out = []
    for i in range(n):
        final = watch / f"small-{time.monotonic_ns()}-{i}_1.json"
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text('{"traceEvents": []}')
        waiter = asyncio.create_task(observer.wait_for(str(final), 60))
        await asyncio.sleep(0.01)  # the expectation is registered before the file appears, as in the agent
        t = time.perf_counter()
        os.rename(tmp, final)
        found = await waiter
        assert found is not None
        out.append(time.perf_counter() - t)
        await asyncio.sleep(gap_s)
    return out


async def observation(big: Path, watch: Path, n: int) -> dict[str, float]:
    observer = Observer()
    observer.start()
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool, abs, 1)  # start the worker process outside the measurement
    try:
        idle = await latencies(watch, n, 0.05, observer)
        t = time.perf_counter()
        verifying = loop.run_in_executor(pool, verify_trace, str(big), expectation())
        await asyncio.sleep(0.5)
        busy = await latencies(watch, n, 0.2, observer)
        assert not verifying.done(), "the big verification finished before the measurement ended: use a bigger file"
        verdict = await verifying
        pool_s = time.perf_counter() - t

        # contrast: the same verification on the loop thread starves the observer for its whole duration
        async def blocking():
            await asyncio.sleep(0.2)
            verify_trace(str(big), expectation())

        blocker = asyncio.create_task(blocking())
        starved = await latencies(watch, 1, 0, observer)
        await blocker
    finally:
        await observer.stop()
        pool.shutdown()
    return {"idle_ms": statistics.median(idle) * 1000, "pool_ms": statistics.median(busy) * 1000,
            "pool_p100_ms": max(busy) * 1000, "loop_thread_ms": starved[0] * 1000, "big_verify_s": pool_s,
            "big_ok": verdict.ok, "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--big-mb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--throughput-only", action="store_true", help="skip the observation-latency part")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="gl-bench-") as d:
        d = Path(d)
        trace = d / "t_4242.json"
        make_trace(trace, a.size_mb)
        tp = throughput(trace, a.runs)
        print(f"file: {trace.stat().st_size / 2**20:.0f} MiB, {a.runs} interleaved runs per variant, medians")
        for how, r in tp.items():
            print(f"  {how:<13} {r['mb_s']:7.1f} MB/s  {r['s']:6.2f} s  peak RSS {r['rss_mb']:7.0f} MiB  ok={r['ok']}")
        print(f"  verify_trace / json.load speed: {tp['verify_trace']['mb_s'] / tp['json.load']['mb_s']:.2f}x, "
              f"memory: {tp['verify_trace']['rss_mb'] / tp['json.load']['rss_mb']:.2f}x")
        print(f"  ijson (yajl2_c, events only) / json.load speed: {tp['ijson']['mb_s'] / tp['json.load']['mb_s']:.2f}x, "
              f"ijson / verify_trace: {tp['ijson']['mb_s'] / tp['verify_trace']['mb_s']:.2f}x")
        if a.throughput_only:
            return
        trace.unlink()
        big = d / "big_4242.json"
        make_trace(big, a.big_mb)
        watch = d / "watch"
        watch.mkdir()
        ob = asyncio.run(observation(big, watch, a.samples))
        print(f"observation latency of a small file (median of {ob['n']}), big file {big.stat().st_size / 2**30:.2f} GiB:")
        print(f"  idle:                                   {ob['idle_ms']:7.1f} ms")
        print(f"  while it verifies in the process pool:  {ob['pool_ms']:7.1f} ms (max {ob['pool_p100_ms']:.1f} ms; "
              f"ratio to idle {ob['pool_ms'] / ob['idle_ms']:.2f}x; verification took {ob['big_verify_s']:.1f} s, ok={ob['big_ok']})")
        print(f"  contrast, verifying on the loop thread: {ob['loop_thread_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
