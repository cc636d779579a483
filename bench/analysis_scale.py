"""`gpulens analyze` wall time and peak memory for 2, 8 and 32 ranks (replicated from a real trace).

Each capture replicates HTA's real 2-rank trace_filter set (ranks 0/1 of one NCCL job, 1.7 MB of
JSON per rank) to N ranks: rank r is a copy of file r % 2 with distributedInfo.rank set to r, in a
file:// archive with a real manifest. The CLI runs as a subprocess; its process tree (the analysis
process plus its forked workers) is sampled every 20 ms for PSS (shared pages counted once) and
the main process's RSS. Sizes are interleaved (2, 8, 32, 2, 8, 32, ...) and medians reported.

    .venv/bin/python bench/analysis_scale.py [--runs 3] [--ranks 2 8 32] [--jobs 2] [--jobs-sweep 1 2 4]
                                             [--python PY ...]

`--jobs-sweep` adds rows for the largest rank count at other --jobs values (parse parallelism), to
show what the bound on concurrent parsers buys in memory and costs in time. `--python` runs every
case with each interpreter given (e.g. venvs with different HTA versions), interleaved, each row
labelled with the HTA version its summary names and its wall time as a ratio to the first one's.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from capture.models import Artifact, ExpectedTarget, Manifest  # noqa: E402

SOURCE = REPO.parent / "shared" / "data" / "traces" / "hta_trace_filter_2rank"


def build_capture(root: Path, n: int) -> str:
    docs = [json.loads(gzip.decompress((SOURCE / f"sampled_rank-{i}.json.gz").read_bytes())) for i in (0, 1)]
    cap = root / "ns" / "train" / "0" / f"c-{n}"
    (cap / "traces").mkdir(parents=True)
    artifacts, expected = [], []
    for r in range(n):
        doc = docs[r % 2]
        doc["distributedInfo"]["rank"] = r
        data = gzip.compress(json.dumps(doc).encode(), compresslevel=1)
        path = cap / "traces" / f"rank-{r}.json.gz"
        path.write_bytes(data)
        artifacts.append(Artifact(f"rank-{r}", r, r % 8, f"node-{r // 8}", f"trainer-{r // 8}", 100 + r, 0,
                                  path.as_uri(), len(data), hashlib.sha256(data).hexdigest(), None))
        expected.append(ExpectedTarget(f"rank-{r}", r, r % 8, f"trainer-{r // 8}", f"node-{r // 8}"))
    # requested just before the traces start, as for a real capture of them (the analysis
    # excludes traces outside the capture window); the trace's timestamps are epoch µs
    first_us = min(e["ts"] for d in docs for e in d["traceEvents"] if e.get("ph") == "X" and "ts" in e)
    m = Manifest(f"c-{n}", "train", 0, first_us / 1e6 - 1.0, 3000, expected, artifacts)
    (cap / "manifest.json").write_text(m.to_json())
    return (cap / "manifest.json").as_uri()


def _sample(proc: psutil.Process, peaks: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            tree = [proc] + proc.children(recursive=True)
            pss = 0
            for p in tree:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peaks["tree_pss"] = max(peaks["tree_pss"], pss)
            peaks["main_rss"] = max(peaks["main_rss"], proc.memory_info().rss)
            peaks["procs"] = max(peaks["procs"], len(tree))
        except psutil.NoSuchProcess:
            return
        stop.wait(0.02)


def run_once(uri: str, jobs: int, python: str = sys.executable) -> dict:
    peaks = {"tree_pss": 0, "main_rss": 0, "procs": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "gpulens.cli", "analyze", uri, "--jobs", str(jobs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(psutil.Process(proc.pid), peaks, stop))
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"analyze failed ({proc.returncode}): {err.decode()[-2000:]}")
    summary = json.loads(Path(out.decode().strip().removeprefix("file://").replace("report.html", "summary.json")).read_text())
    assert summary["counts"]["analysed"] == summary["counts"]["expected"]
    load = next((float(l.split("seconds=")[1].split()[0]) for l in err.decode().splitlines() if "event=traces.loaded" in l), 0.0)
    analyses = sum(a["seconds"] for a in summary["analyses"].values())
    return {"wall": wall, "load": load, "analyses": analyses, **peaks, "hta": summary["tool"]["hta"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--jobs-sweep", type=int, nargs="*", default=[])
    ap.add_argument("--python", nargs="+", default=[sys.executable])
    args = ap.parse_args()
    cases = [(n, args.jobs, py) for n in args.ranks for py in args.python]
    cases += [(max(args.ranks), j, py) for j in args.jobs_sweep if j != args.jobs for py in args.python]
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="gpulens-bench-") as tmp:
        uris = {n: build_capture(Path(tmp), n) for n in args.ranks}
        results: dict[tuple[int, int, str], list[dict]] = {c: [] for c in cases}
        for i in range(args.runs):
            for n, jobs, py in cases:
                results[(n, jobs, py)].append(run_once(uris[n], jobs, py))
                print(f"run {i + 1}/{args.runs} ranks={n} jobs={jobs} hta={results[(n, jobs, py)][-1]['hta']} "
                      f"wall={results[(n, jobs, py)][-1]['wall']:.2f}s", file=sys.stderr)
    base = None
    print(f"\n{args.runs} runs each, interleaved, medians; input per rank: 1.7 MB JSON (~122 KB gzip)\n")
    print("| ranks | --jobs | HTA | wall | vs first HTA | load (parse+align) | analyses | wall per rank vs first row "
          "| peak tree PSS | peak main RSS | max processes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first_py: dict[tuple[int, int], float] = {}
    for n, jobs, py in cases:
        rows = results[(n, jobs, py)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "hta"}
        per_rank = med["wall"] / n
        base = base or per_rank
        ref = first_py.setdefault((n, jobs), med["wall"])
        print(f"| {n} | {jobs} | {rows[0]['hta']} | {med['wall']:.2f} s | {med['wall'] / ref:.2f}x | {med['load']:.2f} s "
              f"| {med['analyses']:.2f} s | {per_rank / base:.2f}x | {med['tree_pss'] / mib:.0f} MiB "
              f"| {med['main_rss'] / mib:.0f} MiB | {med['procs']:.0f} |")


if __name__ == "__main__":
    main()
