"""Evaluation cost of the gpulens rule groups on a real Prometheus, by number of pods.

Runs the Debian Prometheus on 127.0.0.1 against a synthetic exporter (every pod on one GPU of an
8-GPU node, 8 pods per workload, constant rates) with the rules time-scaled by 1/60 and scrape/evaluation every 1 s:
each window then holds as many samples as in production at a 1 m evaluation interval (5 per rate
window, 30 per baseline window), so one evaluation costs what one production evaluation costs.
A reference group with a single per-pod `rate()` record is evaluated side by side; the script
prints the median `evaluationTime` of each group and its ratio to the reference.

    .venv/bin/python bench/alertrules_eval.py [--pods 10,100,1000] [--samples 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulens.alertrules import generate  # noqa: E402

SCALE = 1 / 60
REFERENCE = {"name": "bench.reference", "rules": [{
    "record": "namespace_pod:bench_kernel_launches:rate5m",
    "expr": "sum by (namespace, pod, node) (rate(gpulens_kernel_launches_total[5s]))"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exposition(pods: int, elapsed: float) -> bytes:
    lines = []
    counters = [("gpulens_kernel_launches_total", 2000.0), ("gpulens_graph_launches_total", 5.0),
                ("gpulens_sync_wait_seconds_total", 0.3), ("gpulens_sync_calls_total", 100.0)]
    # 8 pods per workload (a data-parallel job), each on its own GPU
    pod_labels = [f'node="n{i // 8}",gpu="{i % 8}",namespace="ml",pod="p{i}",container="c",'
                  f'gpulens_job="j{i // 8}",gpulens_workload="job/j{i // 8}"' for i in range(pods)]
    for name, rate in counters:
        lines.append(f"# TYPE {name} counter")
        lines += [f"{name}{{{lb}}} {rate * elapsed!r}" for lb in pod_labels]
    lines.append("# TYPE gpulens_memcpy_bytes_total counter")
    for lb in pod_labels:
        lines.append(f'gpulens_memcpy_bytes_total{{{lb},direction="h2d"}} {50e6 * elapsed!r}')
        lines.append(f'gpulens_memcpy_bytes_total{{{lb},direction="d2h"}} {0.2e6 * elapsed!r}')
    lines.append("# TYPE gpulens_process_gpu_memory_bytes gauge")
    lines += [f"gpulens_process_gpu_memory_bytes{{{lb}}} 2e10" for lb in pod_labels]
    lines.append("# TYPE gpulens_gpu_pods gauge")
    lines += [f'gpulens_gpu_pods{{node="n{i // 8}",gpu="{i % 8}"}} 1' for i in range(pods)]
    lines.append("# TYPE gpulens_exporter_source_up gauge")
    lines += [f'gpulens_exporter_source_up{{node="n{n}",source="nvml"}} 1' for n in range((pods + 7) // 8)]
    return ("\n".join(lines) + "\n").encode()


#: rule name -> evaluationTime samples (ms) of the last measure() (recording rules share names
#: across groups only with the reference, which has its own)
per_rule: dict[str, list[float]] = {}


def measure(pods: int, samples: int, warmup: float) -> dict[str, float]:
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = exposition(pods, time.monotonic() - started)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        _, plain = generate.render(time_scale=SCALE)
        files = []
        for name, text in plain.items():
            (tmp_path / name).write_text(text)
            files.append(str(tmp_path / name))
        (tmp_path / "reference.rules.yml").write_text(yaml.safe_dump({"groups": [REFERENCE]}))
        files.append(str(tmp_path / "reference.rules.yml"))
        port = free_port()
        (tmp_path / "p.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": files,
            "scrape_configs": [{"job_name": "gpulens-exporter",
                                "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"]}]}]}))
        proc = subprocess.Popen(["/usr/bin/prometheus", f"--config.file={tmp_path / 'p.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            time.sleep(warmup)  # until the baselines exist
            per_group: dict[str, list[float]] = {}
            per_rule.clear()
            last: dict[str, str] = {}
            while min((len(v) for v in per_group.values()), default=0) < samples:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
                    groups = json.loads(r.read())["data"]["groups"]
                for g in groups:
                    if last.get(g["name"]) != g["lastEvaluation"]:  # one sample per evaluation
                        last[g["name"]] = g["lastEvaluation"]
                        per_group.setdefault(g["name"], []).append(g["evaluationTime"] * 1000)
                        for r in g["rules"]:
                            per_rule.setdefault(r.get("name", "?"), []).append(r["evaluationTime"] * 1000)
                time.sleep(0.3)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
            server.shutdown()
            server.server_close()
    return {name: statistics.median(v) for name, v in per_group.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="10,100,1000")
    ap.add_argument("--samples", type=int, default=20)
    # a pod settles after 10 s and a workload's baseline needs 35 s of history at this scale
    ap.add_argument("--warmup", type=float, default=60.0)
    args = ap.parse_args()
    print(f"{'pods':>6}  {'group':<28} {'median ms':>10} {'x reference':>12} {'us per pod':>11}")
    for pods in (int(p) for p in args.pods.split(",")):
        medians = measure(pods, args.samples, args.warmup)
        ref = medians["bench.reference"]
        for name in ("bench.reference", "gpulens.workload.recording", "gpulens.workload.alerts", "gpulens.exporter.alerts"):
            m = medians[name]
            print(f"{pods:>6}  {name:<28} {m:>10.2f} {m / ref:>12.1f} {m * 1000 / pods:>11.1f}")
        costly = sorted(((statistics.median(v), n) for n, v in per_rule.items()), reverse=True)[:4]
        print(f"{'':>6}  costliest rules: " + ", ".join(f"{n} {m:.2f} ms" for m, n in costly), flush=True)


if __name__ == "__main__":
    main()
