"""The agent's one-pass archive copy (issue 27): verify + gzip + sha256 of the gzip in one read.

1. Throughput on a big trace made of real GPU events (../shared/data/traces, repeated to size, as
   bench/agent_verify.py makes it): each variant in a fresh process (peak RSS is its own),
   interleaved, medians of wall and CPU time (user + system of all threads):
   - `sha256 alone`: read + hash, the floor any verifier that checksums must pay;
   - `json.load`: parse only, what the issue-17 verifier is held against;
   - `verify, no copy`: the verifier as before issue 27 (sha256 of the raw bytes);
   - `verify + gzip <codec> <level>`: the verifier writing the archive copy (capture/agent/staging.py);
   - `verify, then gzip (two reads)`: the same work as two passes, for contrast.
2. Compression ratio and speed of each codec/level on every real trace in ../shared/data/traces
   (decompressed first; in-process, medians of 5).

    python bench/agent_archive.py [--size-mb 1024] [--runs 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_verify import REAL, REAL_BIG_SOURCE, make_real_trace, real_expectation  # noqa: E402

from gpulens.capture.agent.staging import compressor  # noqa: E402

VARIANTS = ("sha256 alone", "verify + gzip isal 1", "verify, no copy", "json.load", "verify + gzip zlib 1",
            "verify + gzip isal 2", "verify + gzip zlib 6", "verify, then gzip zlib 1 (two reads)")

CHILD = r"""
import hashlib, json, os, resource, sys, time
sys.path.insert(0, sys.argv[3])
from gpulens.capture.agent.staging import Staging, compressor
from gpulens.capture.agent.verification import Expectation, verify_trace
path, how, out_dir = sys.argv[1], sys.argv[2], sys.argv[5]
exp = json.loads(sys.argv[4])
exp = Expectation(**(exp | {"activities": tuple(exp["activities"])}))
dest = os.path.join(out_dir, "copy.json.gz")
t, c = time.perf_counter(), time.process_time()
stored = None
if how == "sha256 alone":
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            h.update(data)
    ok = bool(h.hexdigest())
elif how == "json.load":
    with open(path) as f:
        ok = isinstance(json.load(f), dict)
elif how == "verify, no copy":
    v = verify_trace(path, exp)
    ok = v.ok or v.problems[0][:70]
elif how.startswith("verify + gzip"):
    _, _, _, codec, level = how.split()
    v = verify_trace(path, exp, stage=Staging(dest, level=int(level), codec=codec))
    ok, stored = (v.ok and v.stored_path == dest) or (v.problems or [v.stage_error])[0][:70], v.stored_size
else:  # two reads: verify, then compress + hash the copy
    v = verify_trace(path, exp)
    comp, h, stored = compressor(1, "zlib"), hashlib.sha256(), 0
    with open(path, "rb") as f, open(dest, "wb") as out:
        while data := f.read(1 << 20):
            z = comp.compress(data)
            out.write(z); h.update(z); stored += len(z)
        z = comp.flush()
        out.write(z); h.update(z); stored += len(z)
    ok = v.ok or v.problems[0][:70]
run = {"s": time.perf_counter() - t, "cpu": time.process_time() - c, "ok": ok, "stored": stored}
if os.path.exists(dest):
    os.unlink(dest)
print(json.dumps({"run": run, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def throughput(path: Path, runs: int, exp, out_dir: Path, variants=VARIANTS) -> dict[str, dict]:
    repo = str(Path(__file__).resolve().parent.parent)
    got: dict[str, list[dict]] = {how: [] for how in variants}
    for i in range(runs):
        for how in variants:
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), how, repo, json.dumps(asdict(exp)), str(out_dir)],
                                 capture_output=True, text=True, check=True)
            doc = json.loads(out.stdout)
            got[how].append(doc["run"] | {"rss_mb": doc["rss_mb"]})
            print(f"  run {i + 1}: {how}: {json.dumps(got[how][-1])}", flush=True)   # a long run shows progress
    mb = path.stat().st_size / 2**20
    res = {}
    for how, rs in got.items():
        s = statistics.median(r["s"] for r in rs)
        stored = [r["stored"] for r in rs if r["stored"]]
        res[how] = {"mb_s": mb / s, "s": s, "cpu": statistics.median(r["cpu"] for r in rs),
                    "rss_mb": statistics.median(r["rss_mb"] for r in rs), "ok": all(r["ok"] is True for r in rs),
                    "problem": next((r["ok"] for r in rs if r["ok"] is not True), None),
                    "ratio": path.stat().st_size / stored[0] if stored else None}
    return res


def report(path: Path, res: dict[str, dict]) -> None:
    jl, floor = res["json.load"], res["sha256 alone"]
    print(f"real GPU trace events ({REAL_BIG_SOURCE}) repeated: {path.stat().st_size / 2**30:.2f} GiB")
    print(f"  {'variant':<38} {'MB/s':>7} {'wall':>8} {'x json.load':>11} {'x sha256':>9} {'CPU':>8} "
          f"{'peak RSS':>9} {'ratio':>6}")
    for how, r in res.items():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"  {how:<38} {r['mb_s']:7.1f} {r['s']:7.2f}s {jl['s'] / r['s']:10.2f}x {floor['s'] / r['s']:8.2f}x "
              f"{r['cpu']:7.2f}s {r['rss_mb']:6.0f} MiB {ratio:>6}  ok={r['ok']} {r['problem'] or ''}")


CODECS = (("isal", 0), ("isal", 1), ("isal", 2), ("isal", 3), ("zlib", 1), ("zlib", 3), ("zlib", 6), ("zlib", 9))


def ratios() -> None:
    print("compression of each real trace as it is (ratio = raw / gzip; MB/s of the compressor alone, median of 5):")
    files = sorted(REAL.glob("*/*.json.gz"))
    print(f"  {'codec':<8} " + " ".join(f"{p.parent.name[:14] + '/' + p.name[:16]:>34}" for p in files))
    raws = [gzip.decompress(p.read_bytes()) for p in files]
    for codec, level in CODECS:
        cells = []
        for raw in raws:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                c = compressor(level, codec)
                out = c.compress(raw) + c.flush()
                times.append(time.perf_counter() - t)
            assert zlib.decompress(out, 31) == raw
            cells.append(f"{len(raw) / len(out):6.2f}x {len(raw) / 2**20 / statistics.median(times):7.1f} MB/s")
        print(f"  {codec} {level:<3} " + " ".join(f"{c:>34}" for c in cells))
    print("  sizes: " + ", ".join(f"{p.name} {len(r) / 1024:.0f} KiB raw" for p, r in zip(files, raws)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--ratios-only", action="store_true")
    ap.add_argument("--variants", help="variant names separated by | (default: all, in this order: "
                                       + ", ".join(VARIANTS) + ")")
    a = ap.parse_args()
    variants = tuple(v.strip() for v in a.variants.split("|")) if a.variants else VARIANTS
    assert set(variants) <= set(VARIANTS) and "sha256 alone" in variants and "json.load" in variants, variants
    ratios()
    if a.ratios_only:
        return
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="gl-bench-") as d:
        d = Path(d)
        real = d / "real_4037.json"
        make_real_trace(real, a.size_mb)
        exp = real_expectation(gzip.decompress((REAL / REAL_BIG_SOURCE).read_bytes()))
        print(f"{a.runs} interleaved fresh-process runs per variant, medians; x = the reference's time / the variant's",
              flush=True)
        report(real, throughput(real, a.runs, exp, d, variants))


if __name__ == "__main__":
    main()
