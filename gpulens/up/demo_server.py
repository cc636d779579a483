"""One replica of the serving demo `gpulens up --demo --serving` runs: two of these, each a pod of
the Deployment demo/demo-serve (one revision), armed by the trainer hook like any pod.

A replica is a small PyTorch CPU model behind an HTTP endpoint (`POST /v1/predict`, JSON rows of
64 features, answer `{"label": ...}`; `GET /healthz`), loaded by its own client: a load generator
thread that sends requests over one keep-alive connection, one after the other (`--rate 0`, a
closed loop, as one client's requests are) or paced to `--rate` per second, and prints the
latency it sees (`demo-load ... p50_ms= p95_ms=`) every `--report-s`: the p95 a serving team
watches, which the noisy neighbour raises.

Each request is decoded on the host (the JSON, plus `--host-ms` of work), goes through the model's
forward only (`torch.no_grad`, no optimizer: serving has no steps), drives the CUDA driver
stand-in (exporter/stub) as a GPU server would (input to the device, kernels, a synchronous read
of the answer), and its label is read on the host (`aten::item`) for the response. Each request
is one `serve.request` span in traces (a user annotation, as servers mark theirs).

The server is the standard library's single-threaded HTTPServer on purpose: every request runs on
the main thread, one at a time, where Kineto's on-demand capture sees its operators, as a model
server's one inference thread does. It listens on loopback only (port 0: the kernel picks one).

Each replica has its own (stand-in) GPU, `--device`: a noisy neighbour started on one GPU delays
only the replica there. Its synchronous reads wait behind the neighbour's kernels on the shared
device timeline, so it answers fewer requests per second, each later, while its own operators take
as long per call as its healthy peer's: what the report's comparison with the peer shows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

#: the span each request is in the trace (a user annotation)
REQUEST_SPAN = "serve.request"
FEATURES = 64          # the model's input width
MAX_ROWS = 32          # rows per request (the batch)
MAX_BODY = 256 << 10   # bytes; 32 rows of 64 JSON floats are ~45 KiB


class BadRequest(ValueError):
    """A request body that is not `{"inputs": [[64 numbers], ...]}` with 1..MAX_ROWS rows."""


def parse_inputs(body: bytes) -> list[list[float]]:
    """The request's rows, checked: a client's mistake is a 400 with the reason, never a 5xx."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    rows = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ROWS:
        raise BadRequest(f'want {{"inputs": [...]}} with 1..{MAX_ROWS} rows')
    for i, row in enumerate(rows):
        if (not isinstance(row, list) or len(row) != FEATURES
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)):
            raise BadRequest(f"row {i}: want {FEATURES} numbers")
    return rows


def serve_one(model, request, device, *, kernels: int, kernel_us: int, h2d_bytes: int) -> int:
    """Answer one request: forward pass, the device's share of it, the answer read on the host."""
    import torch

    with torch.no_grad():
        logits = model(request)
        device.step(kernels=kernels, kernel_us=kernel_us, h2d_bytes=h2d_bytes)   # waits for the answer
        return int(logits.argmax(dim=-1)[0].item())


class Replica:
    """The model on its device, and what one request costs on the host."""

    def __init__(self, model, device, pod: str, *, host_ms: float, kernels: int, kernel_us: int, h2d_bytes: int):
        self.model, self.device, self.pod = model, device, pod
        self.host_s = host_ms / 1000
        self.work = dict(kernels=kernels, kernel_us=kernel_us, h2d_bytes=h2d_bytes)
        self.served = 0

    def answer(self, body: bytes) -> int:
        import torch

        with torch.profiler.record_function(REQUEST_SPAN):
            rows = parse_inputs(body)                    # BadRequest leaves the span as it came
            time.sleep(self.host_s)                      # the rest of decoding (tokenising, resizing...)
            label = serve_one(self.model, torch.tensor(rows, dtype=torch.float32), self.device, **self.work)
        self.served += 1
        return label


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"              # keep-alive: the load generator's one connection
    # headers and body are two writes: with Nagle on, the body waits for the client's delayed ACK
    # (measured: +20 ms a request, 14.8 against 23 requests/s)
    disable_nagle_algorithm = True
    server: "ReplicaServer"

    def _reply(self, code: int, doc: dict, *, close: bool = False) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path != "/healthz":
            return self._reply(404, {"error": f"no such path {self.path!r}: POST /v1/predict, GET /healthz"})
        self._reply(200, {"pod": self.server.replica.pod, "served": self.server.replica.served})

    def do_POST(self) -> None:
        if self.path != "/v1/predict":
            return self._reply(404, {"error": f"no such path {self.path!r}: POST /v1/predict"}, close=True)
        raw = self.headers.get("Content-Length")
        if raw is None:
            return self._reply(411, {"error": "Content-Length required"}, close=True)
        if not raw.isdigit():
            return self._reply(400, {"error": f"bad Content-Length {raw!r}"}, close=True)
        if int(raw) > MAX_BODY:                    # not read: the connection closes instead
            return self._reply(413, {"error": f"body over {MAX_BODY} bytes"}, close=True)
        body = self.rfile.read(int(raw))
        try:
            label = self.server.replica.answer(body)
        except BadRequest as e:
            return self._reply(400, {"error": str(e)})
        self._reply(200, {"label": label, "pod": self.server.replica.pod})

    def _not_allowed(self) -> None:
        self._reply(405, {"error": f"{self.command} not allowed: POST /v1/predict, GET /healthz"}, close=True)

    do_PUT = do_DELETE = do_PATCH = _not_allowed

    def log_message(self, *args) -> None:      # a line per request would drown the log: demo-load reports
        pass


class ReplicaServer(HTTPServer):
    def __init__(self, replica: Replica, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.replica = replica


def request_body(rows: int = MAX_ROWS, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return json.dumps({"inputs": [[round(rng.gauss(0, 1), 4) for _ in range(FEATURES)] for _ in range(rows)]}).encode()


class LoadGenerator(threading.Thread):
    """The replica's steady client: POSTs over one keep-alive connection and reports the latency it
    sees, per window of `report_s` (what a serving dashboard's p95 is)."""

    def __init__(self, port: int, pod: str, *, rate: float, requests: int, report_s: float, on_done):
        super().__init__(name="demo-load", daemon=True)
        self.port, self.pod, self.rate, self.requests, self.report_s = port, pod, rate, requests, report_s
        self.on_done = on_done
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 -- said once, then the replica stops as a crashed client would
            self.error = f"{type(e).__name__}: {e}"
            print(f"demo-load pod={self.pod} failed: {self.error}", file=sys.stderr, flush=True)
        finally:
            self.on_done()

    def _load(self) -> None:
        body, headers = request_body(), {"Content-Type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        sent, window, window_start = 0, [], time.monotonic()
        next_at = time.monotonic()
        while self.requests == 0 or sent < self.requests:
            if self.rate > 0:
                next_at += 1 / self.rate
                time.sleep(max(0.0, next_at - time.monotonic()))
            t0 = time.monotonic()
            conn.request("POST", "/v1/predict", body=body, headers=headers)
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"replica answered {resp.status}: {answer[:200]!r}")
            window.append((time.monotonic() - t0) * 1000)
            sent += 1
            now = time.monotonic()
            if now - window_start >= self.report_s or sent == self.requests:
                self._report(sent, window, now - window_start)
                window, window_start = [], now
        conn.close()

    def _report(self, sent: int, window: list[float], span_s: float) -> None:
        p95 = statistics.quantiles(window, n=20, method="inclusive")[18] if len(window) > 1 else window[0]
        print(f"demo-load pod={self.pod} requests={sent} rps={len(window) / span_s:.1f} "
              f"p50_ms={statistics.median(window):.1f} p95_ms={p95:.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libcuda", required=True, help="path of the stand-in libcuda.so.1")
    ap.add_argument("--device", type=int, default=0, help="the stand-in GPU this replica runs on")
    ap.add_argument("--port", type=int, default=0, help="loopback port to listen on (0: any free one)")
    ap.add_argument("--requests", type=int, default=0,
                    help="the load generator stops after this many and the replica exits (0: until stopped)")
    ap.add_argument("--rate", type=float, default=0.0, help="requests per second (0: the next as soon as answered)")
    ap.add_argument("--no-load", action="store_true", help="serve only: no load generator (requests come from outside)")
    ap.add_argument("--report-s", type=float, default=10.0, help="seconds per latency line")
    ap.add_argument("--kernels", type=int, default=40)
    ap.add_argument("--kernel-us", type=int, default=100)
    ap.add_argument("--h2d-bytes", type=int, default=4 << 20)
    ap.add_argument("--host-ms", type=float, default=20.0, help="host time to decode each request, beyond the JSON")
    args = ap.parse_args(argv)

    import torch

    from gpulens.exporter.stub import StubDriver

    torch.set_num_threads(1)
    pod = os.environ.get("GPULENS_POD_NAME", "replica")
    device = StubDriver(args.libcuda, device=args.device)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    replica = Replica(model, device, pod, host_ms=args.host_ms, kernels=args.kernels, kernel_us=args.kernel_us,
                      h2d_bytes=args.h2d_bytes)
    server = ReplicaServer(replica, args.port)
    port = server.server_address[1]
    print(f"demo-server pod={pod} pid={os.getpid()} device={args.device} listening on http://127.0.0.1:{port}",
          flush=True)
    load = None
    if not args.no_load:
        # shutdown() waits for serve_forever to notice: from the load thread, never the serving one
        load = LoadGenerator(port, pod, rate=args.rate, requests=args.requests, report_s=args.report_s,
                             on_done=server.shutdown)
        load.start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        device.close()
    return 1 if load is not None and load.error else 0


if __name__ == "__main__":
    sys.exit(main())
