"""Run the real Prometheus (Debian package) on 127.0.0.1 for a test, and a catalogue-shaped
exporter double. Every process started here is stopped by its process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import yaml

from gpulens.alertrules import promql

PROMETHEUS = "/usr/bin/prometheus"


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_query(base: str, expr: str) -> dict:
    data = urllib.parse.urlencode({"query": expr}).encode()
    req = urllib.request.Request(f"{base}/api/v1/query", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400/422 carry the parser's error as JSON
        return json.loads(e.read())


def wait_for(what: str, check: Callable[[], bool], timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) while waiting for {what}")
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.25)
    raise TimeoutError(f"{what} (last error: {last})")


@contextmanager
def prometheus(tmp: Path, port: int, targets: list[str], rule_files: list[Path],
               interval: str = "1s") -> Iterator[str]:
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "gpulens-exporter", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus ready", lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200,
                 60, proc)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def rules_evaluated_ok(base: str) -> tuple[bool, list[str]]:
    """(all rules evaluated at least once and healthy, problems)."""
    groups = get_json(f"{base}/api/v1/rules")["data"]["groups"]
    problems = []
    for g in groups:
        for r in g["rules"]:
            if r["health"] != "ok" or r.get("lastEvaluation", "").startswith("0001"):
                problems.append(f"{g['name']}/{r['name']}: {r['health']} {r.get('lastError', '')}")
    return (bool(groups) and not problems), problems


class ExporterDouble:
    """Stands for the exporter's `GET /metrics`: Prometheus text format 0.0.4 with every metric of
    exporter/metrics.yaml (HELP and TYPE lines, catalogue labels), for one pod on one GPU.
    Counters grow at rates that `rates(elapsed_s)` returns, so a test can script an incident."""

    def __init__(self, rates: Callable[[float], dict[str, float]]) -> None:
        self.catalogue = yaml.safe_load(promql.CATALOGUE_PATH.read_text())["metrics"]
        self.rates = rates
        self.started = time.monotonic()
        self.totals: dict[str, float] = {}
        self.last = 0.0
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def _advance(self) -> float:
        now = time.monotonic() - self.started
        step, t = 0.05, self.last
        while t < now:  # integrate the scripted rates
            dt = min(step, now - t)
            for key, rate in self.rates(t).items():
                self.totals[key] = self.totals.get(key, 0.0) + rate * dt
            t += dt
        self.last = now
        return now

    def _value(self, metric: dict, labels: dict[str, str]) -> float:
        name = metric["name"]
        if metric["type"] == "counter":
            key = name + (f":{labels['direction']}" if "direction" in labels else "")
            return self.totals.get(key, 0.0)
        return {"gpulens_gpu_pods": 1, "gpulens_gpu_processes": 1, "gpulens_process_gpu_memory_bytes": 20e9,
                "gpulens_process_gpu_utilization_ratio": 0.9, "gpulens_dcgm_gpu_utilization_ratio": 0.95,
                "gpulens_dcgm_sm_active_ratio": 0.7, "gpulens_dcgm_memory_used_bytes": 21e9,
                "gpulens_dcgm_power_watts": 300, "gpulens_dcgm_temperature_celsius": 60,
                "gpulens_exporter_source_up": 1, "gpulens_exporter_source_info": 1,
                "gpulens_exporter_probes_attached": 12, "gpulens_exporter_libraries_attached": 1,
                "gpulens_exporter_tracked_processes": 1, "gpulens_exporter_map_entries": 1,
                "gpulens_exporter_map_capacity": 4096, "gpulens_exporter_scrape_duration_seconds": 0.01}[name]

    def _label_sets(self, metric: dict) -> list[dict[str, str]]:
        values = {"node": "test-node", "gpu": "0", "namespace": "ml", "pod": "trainer-0", "container": "trainer",
                  "gpulens_job": "llama-ft", "source": "ebpf", "state": "up", "reason": "ok", "map": "procs"}
        base = {k: values[k] for k in metric["labels"] if k in values}
        if "direction" in metric["labels"]:
            dirs = ("tx", "rx") if "pcie" in metric["name"] else ("h2d", "d2h")
            return [{**base, "direction": d} for d in dirs]
        return [base]

    def exposition(self) -> bytes:
        with self.lock:
            self._advance()
            lines = []
            for m in self.catalogue:
                lines.append(f"# HELP {m['name']} {m['help']}")
                lines.append(f"# TYPE {m['name']} {m['type']}")
                for labels in self._label_sets(m):
                    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    lines.append(f"{m['name']}{{{text}}} {self._value(m, labels)!r}")
            return ("\n".join(lines) + "\n").encode()

    @contextmanager
    def serve(self, port: int) -> Iterator[str]:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = double.exposition()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(timeout=5)
