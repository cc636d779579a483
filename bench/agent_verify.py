"""Node agent benchmarks: verification throughput, and observation latency under a big verification.

1. Throughput: the agent's streaming verifier (`verify_trace`: parse, every check, sha256) next to
   a plain `json.load` of the same file, each in a fresh process (so peak RSS is the variant's
   own), interleaved, medians of wall and CPU time (CPU: user + system of all the process's
   threads; steadier than wall on a shared machine). Side by side: the verifier as built (16 KiB
   event batches decoded by orjson, checked by C-level passes, sha256 on a helper thread), the
   same with 1 MiB batches, the same with the stdlib scanner decoding the batches, the same reading one event per scanner call (the
   reader before issue 17), and ijson's C backend (yajl2_c) doing the same per-event checks and
   the sha256 over the events only (its upper bound). Two large files: a synthetic Kineto-shaped
   CPU trace and one made of a real GPU trace's events (../shared/data/traces, repeated to size);
   then each real trace file as it is (small: N runs in one process).
2. Observation latency: small trace files renamed into a watched folder, time until the agent's
   observer reports them, (a) idle, (b) while a ~1 GB file verifies in the agent's process pool,
   and (c) for contrast, while the same verification runs on the event loop thread (what the
   design forbids). Medians over the small files.

    python bench/agent_verify.py [--size-mb 200] [--big-mb 1024] [--runs 3] [--dir /var/tmp] [--throughput-only]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpulens.capture.agent.observation import Observer  # noqa: E402
from gpulens.capture.agent.verification import Expectation, verify_trace  # noqa: E402

PID = 4242
REAL = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces"
REAL_BIG_SOURCE = "hta_trace_filter_2rank/sampled_rank-0.json.gz"


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


def real_expectation(data: bytes) -> Expectation:
    """What a real trace passes: its own pid and categories, a window around its events."""
    events = json.loads(data)["traceEvents"]
    cpu = [e["pid"] for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    cats = tuple(sorted({e["cat"] for e in events if isinstance(e.get("cat"), str)}))
    return Expectation(cats, window_start=0, window_end=4e9, duration_ms=10**9, pid=max(set(cpu), key=cpu.count))


def make_real_trace(path: Path, size_mb: int) -> None:
    """A real GPU trace's events (cpu_op, cuda_runtime, kernel, memcpy, metadata) repeated to size,
    under Kineto's top-level keys (baseTimeNanoseconds 0: its ts are unix microseconds)."""
    events = json.loads(gzip.decompress((REAL / REAL_BIG_SOURCE).read_bytes()))["traceEvents"]
    body = ", ".join(json.dumps(e) for e in events)
    del events
    reps = max(1, (size_mb << 20) // len(body))
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "bench"}], "displayTimeUnit": "ms", '
                '"baseTimeNanoseconds": 0, "traceEvents": [')
        for i in range(reps):
            f.write(body if i == 0 else ", " + body)
        f.write(f'], "traceName": {json.dumps(str(path))}}}')


# --- 1. throughput -----------------------------------------------------------------------------

VARIANTS = ("json.load", "verify_trace", "verify, 1 MiB batches", "verify, stdlib batches", "verify, one by one (before)",
            "ijson yajl2_c")

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
path, how, runs = sys.argv[1], sys.argv[2], int(sys.argv[5])
import gpulens.capture.agent.jsonstream as js
from gpulens.capture.agent.verification import Expectation, verify_trace
exp = json.loads(sys.argv[4])
exp = Expectation(**(exp | {"activities": tuple(exp["activities"])}))
if how == "verify, 1 MiB batches":                 # objects of a batch no longer fit the CPU cache
    js.TraceStream.batch_chars = 1 << 20
elif how == "verify, stdlib batches":
    js.TraceStream.fast_loads = None
elif how == "verify, one by one (before)":          # one scanner call per event, the per-event loop
    js.TraceStream._batch = lambda self: -1


def ijson_verify(path):
    # ijson's C backend doing the same per-event work (events only: it has no cheap way to hand back
    # the top-level keys as well, so this is an upper bound for it)
    import hashlib, ijson
    from gpulens.capture.agent.verification import _Tally
    assert ijson.backend == "yajl2_c", ijson.backend
    sha = hashlib.sha256()
    class Hashing:
        def __init__(self, f):
            self.f = f
        def read(self, n):
            d = self.f.read(n)
            sha.update(d)
            return d
    tally = _Tally(exp.pid, [])
    with open(path, "rb") as f:
        for item in ijson.items(Hashing(f), "traceEvents.item", use_float=True, buf_size=1 << 20):
            tally.one(item)
    sha.hexdigest()
    return not tally.foreign_pids and tally.events > 0


out = []
for _ in range(runs):
    t, c = time.perf_counter(), time.process_time()
    if how == "json.load":
        with open(path) as f:
            doc = json.load(f)
        ok = isinstance(doc, dict)
        del doc
    elif how == "ijson yajl2_c":
        ok = ijson_verify(path)
    else:
        v = verify_trace(path, exp)
        ok = v.ok or v.problems[0][:70]
    out.append({"s": time.perf_counter() - t, "cpu": time.process_time() - c, "ok": ok})
print(json.dumps({"runs": out, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def throughput(path: Path, runs: int, exp: Expectation, in_process: int = 1) -> dict[str, dict[str, float]]:
    """Each variant in a fresh process per run, interleaved; `in_process` runs inside each (small files).
    The expectation travels as JSON: the child's peak RSS is its variant's own."""
    repo = str(Path(__file__).resolve().parent.parent)
    exp_kind = json.dumps(asdict(exp))
    results: dict[str, list[dict]] = {how: [] for how in VARIANTS}
    rss: dict[str, list[float]] = {how: [] for how in VARIANTS}
    for _ in range(runs):
        for how in VARIANTS:
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), how, repo, exp_kind, str(in_process)],
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout)
            results[how] += got["runs"]
            rss[how].append(got["rss_mb"])
    mb = path.stat().st_size / 2**20
    return {how: {"mb_s": mb / statistics.median(r["s"] for r in rs), "s": statistics.median(r["s"] for r in rs),
                  "cpu": statistics.median(r["cpu"] for r in rs), "rss_mb": statistics.median(rss[how]),
                  "ok": all(r["ok"] is True for r in rs), "problems": [r["ok"] for r in rs if r["ok"] is not True][:1]}
            for how, rs in results.items()}


def report(title: str, path: Path, tp: dict[str, dict[str, float]]) -> None:
    base = tp["json.load"]
    print(f"{title}: {path.stat().st_size / 2**20:.1f} MiB")
    print(f"  {'variant':<30} {'MB/s':>7} {'wall':>8} {'x json.load':>11} {'CPU':>8} {'x json.load':>11} {'peak RSS':>9}")
    for how, r in tp.items():
        print(f"  {how:<30} {r['mb_s']:7.1f} {r['s']:7.3f}s {base['s'] / r['s']:10.2f}x {r['cpu']:7.3f}s "
              f"{base['cpu'] / r['cpu']:10.2f}x {r['rss_mb']:6.0f} MiB  ok={r['ok']} {r['problems'] or ''}")


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
    ap.add_argument("--small-runs", type=int, default=20, help="runs per process on each real trace file as it is")
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--throughput-only", action="store_true", help="skip the observation-latency part")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="gl-bench-") as d:
        d = Path(d)
        print(f"{a.runs} interleaved fresh-process runs per variant, medians; x json.load = json.load's time / the variant's")
        trace = d / "t_4242.json"
        make_trace(trace, a.size_mb)
        report("synthetic Kineto-shaped CPU trace", trace, throughput(trace, a.runs, expectation()))
        trace.unlink()
        real = d / "real_4037.json"
        make_real_trace(real, a.size_mb)
        source = gzip.decompress((REAL / REAL_BIG_SOURCE).read_bytes())
        report(f"real GPU trace events ({REAL_BIG_SOURCE}) repeated", real,
               throughput(real, a.runs, real_expectation(source)))
        del source
        real.unlink()
        for gz in sorted(REAL.glob("*/*.json.gz")):
            small = d / gz.name.removesuffix(".gz")
            small.write_bytes(gzip.decompress(gz.read_bytes()))
            report(f"real trace as it is, {gz.parent.name}/{gz.name} ({a.small_runs} runs per process)", small,
                   throughput(small, a.runs, real_expectation(small.read_bytes()), a.small_runs))
        if a.throughput_only:
            return
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
