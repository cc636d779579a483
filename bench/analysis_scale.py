"""`gpulens analyze` at realistic sizes: the single-process path before issue 28 beside the Dask
map/reduce path, in the same run: wall time, peak RSS of the driver and of the largest worker.

Each rank's trace is ~`--mb` MB of JSON made from the real events of HTA's trace_filter set
(ranks 0/1 of one NCCL job, 1.7 MB each): rank r repeats file r % 2's events, shifted in time by
the file's span per copy, until the JSON reaches the size. The files carry no distributedInfo
(like dynolog on-demand traces; analysis inserts the rank), so all ranks of one parity are the
same bytes: they are hard links in a file:// archive with a real manifest.

"before" runs `gpulens analyze` from `git archive <--before-ref>` (default: the commit before the
map/reduce split): one process loads every rank into one HTA trace (its forked parsers at most
--jobs at a time). "dask" runs the working tree: a local Dask cluster of --jobs workers, one rank
per task. Both run as subprocesses with --out; the process tree is sampled every 50 ms for RSS
(driver = the CLI process; workers = its descendants); for Dask workers the exact peak (ru_maxrss)
from the per-rank summaries is used as well. Cases are interleaved across runs; medians reported.

    .venv/bin/python bench/analysis_scale.py [--runs 1] [--ranks 8 32] [--mb 30] [--jobs 2]
                                             [--paths before dask] [--before-ref eeebf13]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import io
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from gpulens.capture.models import Artifact, ExpectedTarget, Manifest  # noqa: E402

SOURCE = REPO.parent / "shared" / "data" / "traces" / "hta_trace_filter_2rank"
BEFORE_REF = "eeebf13"  # the last commit with the single-process analysis


def make_traces(root: Path, mb: int) -> tuple[list[Path], float]:
    """Two ~mb MB rankless traces (from rank 0 and rank 1 events); the earliest event (epoch s)."""
    import gzip
    out, first = [], None
    for i in (0, 1):
        doc = json.loads(gzip.decompress((SOURCE / f"sampled_rank-{i}.json.gz").read_bytes()))
        doc.pop("distributedInfo", None)
        events = doc["traceEvents"]
        xs = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
        t0 = min(e["ts"] for e in xs)
        first = t0 if first is None else min(first, t0)
        span = max(e["ts"] + e.get("dur", 0) for e in xs) - t0 + 1
        one = len(json.dumps(events))
        ids = _id_stride(events)
        doc["traceEvents"] = [_copy(e, k, span, ids) for k in range(max(1, (mb << 20) // one)) for e in events]
        path = root / f"source-{i}.json"
        path.write_bytes(json.dumps(doc).encode())
        out.append(path)
    return out, first / 1e6


#: Kineto's ids that pair events: a launch and its kernel share `correlation`, a CPU op and its
#: launches `External id`. Each copy gets its own, as a longer real trace has: with the ids repeated,
#: HTA's launch-stats join on `correlation` is many-to-many (k copies: k^2 rows per launch), which
#: made the previous bench's worker peak grow with k (60x one trace at 17 copies; BENCHMARKS.md).
ID_ARGS = ("correlation", "External id")


def _id_stride(events: list[dict]) -> int:
    return 1 + max((int(v) for e in events for k, v in (e.get("args") or {}).items()
                    if k in ID_ARGS and isinstance(v, (int, float))), default=0)


def _copy(e: dict, k: int, span: float, stride: int) -> dict:
    """Copy k of event e: shifted in time by k spans, its pairing ids by k strides."""
    if "ts" not in e:
        return e
    out = dict(e, ts=e["ts"] + k * span)
    args = e.get("args")
    if k and args and any(n in args for n in ID_ARGS):
        out["args"] = dict(args, **{n: args[n] + k * stride for n in ID_ARGS if isinstance(args.get(n), (int, float))})
    return out


def build_capture(root: Path, n: int, sources: list[Path], first_s: float) -> str:
    cap = root / "ns" / "train" / "0" / f"c-{n}"
    (cap / "traces").mkdir(parents=True)
    digests = [(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sources]
    artifacts, expected = [], []
    for r in range(n):
        path = cap / "traces" / f"rank-{r}.json"
        os.link(sources[r % 2], path)
        size, sha = digests[r % 2]
        artifacts.append(Artifact(f"rank-{r}", r, r % 8, f"node-{r // 8}", f"trainer-{r // 8}", 100 + r, 0,
                                  path.as_uri(), size, sha, None))
        expected.append(ExpectedTarget(f"rank-{r}", r, r % 8, f"trainer-{r // 8}", f"node-{r // 8}"))
    # the replicated events span (copies x 2 s): a window long enough that no trace ends after it
    m = Manifest(f"c-{n}", "train", 0, first_s - 1.0, 3000, expected, artifacts,
                 created_at=first_s + 24 * 3600)
    (cap / "manifest.json").write_text(m.to_json())
    return (cap / "manifest.json").as_uri()


def export_ref(ref: str, dest: Path) -> Path:
    data = subprocess.run(["git", "-C", str(REPO), "archive", ref, "capture", "gpulens", "hooks", "exporter", "tests"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _sample(proc: psutil.Process, peaks: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            peaks["driver_rss"] = max(peaks["driver_rss"], proc.memory_info().rss)
            for c in proc.children(recursive=True):
                try:
                    peaks["worker_rss"] = max(peaks["worker_rss"], c.memory_info().rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            return
        stop.wait(0.05)


def run_once(uri: str, path: str, jobs: int, code: Path, out: Path) -> dict:
    peaks = {"driver_rss": 0, "worker_rss": 0}
    env = dict(os.environ, PYTHONPATH=str(code))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gpulens.cli", "analyze", uri, "--jobs", str(jobs), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=code, env=env)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(psutil.Process(proc.pid), peaks, stop))
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{path} analyze failed ({proc.returncode}): {err.decode()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["analysed"] == summary["counts"]["expected"], summary["counts"]
    exact = [json.loads(p.read_text())["worker"]["peak_rss_bytes"] for p in (out / "ranks").glob("*.json")] \
        if (out / "ranks").is_dir() else []
    return {"wall": wall, "driver_rss": peaks["driver_rss"], "worker_rss": max([peaks["worker_rss"], *exact])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--mb", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--paths", nargs="+", default=["before", "dask"], choices=["before", "dask"])
    ap.add_argument("--before-ref", default=BEFORE_REF)
    ap.add_argument("--after-ref", default=None, help="run the Dask path from this git ref (default: the working tree)")
    ap.add_argument("--only", nargs="*", default=[], help="path:ranks cases to run, e.g. dask:128 (default: all)")
    args = ap.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="gpulens-bench-") as tmp:
        tmp = Path(tmp)
        sources, first = make_traces(tmp, args.mb)
        json_mb = statistics.mean(p.stat().st_size for p in sources) / mib
        uris = {n: build_capture(tmp / "archive", n, sources, first) for n in args.ranks}
        code = {"dask": export_ref(args.after_ref, tmp / "after") if args.after_ref else REPO}
        if "before" in args.paths:
            code["before"] = export_ref(args.before_ref, tmp / "before")
        cases = [(p, n) for n in args.ranks for p in args.paths if not args.only or f"{p}:{n}" in args.only]
        results: dict[tuple[str, int], list[dict]] = {c: [] for c in cases}
        for i in range(args.runs):
            for path, n in cases:
                r = run_once(uris[n], path, args.jobs, code[path], tmp / f"out-{path}-{n}-{i}")
                results[(path, n)].append(r)
                print(f"run {i + 1}/{args.runs} {path} ranks={n} wall={r['wall']:.1f}s driver={r['driver_rss'] / mib:.0f}MiB "
                      f"worker={r['worker_rss'] / mib:.0f}MiB", file=sys.stderr, flush=True)
    print(f"\n{args.runs} run(s) each, interleaved, medians; {json_mb:.1f} MB of JSON per rank; --jobs {args.jobs}; "
          f"before = {args.before_ref}\n")
    print("| ranks | path | wall | wall vs before | peak driver RSS | largest worker peak RSS | worker / one trace's JSON |")
    print("|---|---|---|---|---|---|---|")
    for path, n in cases:
        rows = results[(path, n)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        before = results.get(("before", n))
        ratio = f"{med['wall'] / statistics.median(r['wall'] for r in before):.2f}x" if before else "—"
        print(f"| {n} | {path} | {med['wall']:.1f} s | {ratio} | {med['driver_rss'] / mib:.0f} MiB "
              f"| {med['worker_rss'] / mib:.0f} MiB | {med['worker_rss'] / mib / json_mb:.1f}x |")


if __name__ == "__main__":
    main()
