"""Coordinator overhead at scale: 1,000 targets over 50 simulated node agents.

Measures, per capture, the time from the end of the trace window to convergence (every target
terminal, manifest written), and the coordinator process's peak memory (VmHWM), side by side with
a baseline of 20 targets on 1 agent, and with a scenario where one of the 50 agents never answers
(a node that drops packets): there the time until the 49 healthy agents' 980 targets were all
archived is what counts, not the convergence (which waits for the deadline by design).

The simulated agents (one child process, 50 aiohttp servers on 127.0.0.1) speak the documented
agent API (PUT dispatch, GET statuses); a target turns `archived` (with a schema-valid artifact)
at requested_at + start delay + window + a per-capture jitter in [0, 1) s, i.e. at "window end"
(the jitter spreads window ends over the poll phase, so medians are not an artefact of alignment). The coordinator runs in its own
child process (the real Coordinator and HTTP app, local discovery over real registration files),
one per scenario; runs are interleaved and medians reported.

    .venv/bin/python bench/coordinator_scale.py [--runs 5] [--window-ms 2000] [--poll-interval-s 1.0] [--start-delay-s 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKEN = "bench-token"
START_DELAY_S = float(os.environ.get("GPULENS_BENCH_START_DELAY_S", "12"))   # dynolog's nominal: poll 5 s + warm-up 7 s


def _jitter(capture_id: str) -> float:
    import zlib
    return (zlib.crc32(capture_id.encode()) % 1000) / 1000.0


# --- child: simulated agents ---------------------------------------------------------------------

async def _agents(count: int, black_hole: int | None) -> None:
    from aiohttp import web

    from gpulens.capture.models import Dispatch

    def artifact(d: Dispatch, tid: str) -> dict:
        return {"target_id": tid, "rank": d.rank, "local_rank": d.local_rank or 0, "node": "n", "pod": d.pod or "p",
                "pid": 1000 + d.rank, "attempt": d.attempt, "uri": f"{d.archive_prefix}/traces/{tid}.json",
                "size": 4_000_000, "sha256": "ab" * 32, "trace_id": f"T{d.rank}"}

    def make(i: int) -> web.Application:
        captures: dict[str, dict[str, Dispatch]] = {}

        def status(cid: str, tid: str, d: Dispatch) -> dict:
            done = time.time() >= (d.requested_at or 0) + START_DELAY_S + _jitter(cid) + d.duration_ms / 1000
            return {"target_id": tid, "state": "archived" if done else "queued_by_dynolog", "reason": None,
                    "detail": None, "updated_at": time.time(), "artifact": artifact(d, tid) if done else None}

        async def put(request: web.Request) -> web.Response:
            if i == black_hole:
                await asyncio.sleep(3600)
            cid, tid = request.match_info["cid"], request.match_info["tid"]
            d = Dispatch.from_dict(await request.json())
            new = tid not in captures.setdefault(cid, {})
            captures[cid].setdefault(tid, d)
            return web.json_response(status(cid, tid, captures[cid][tid]), status=202 if new else 200)

        async def get(request: web.Request) -> web.Response:
            if i == black_hole:
                await asyncio.sleep(3600)
            cid = request.match_info["cid"]
            if cid not in captures:
                return web.json_response({"error": "unknown"}, status=404)
            return web.json_response({"capture_id": cid, "targets": [status(cid, t, d) for t, d in captures[cid].items()]})

        app = web.Application()
        app.router.add_put("/v1/captures/{cid}/targets/{tid}", put)
        app.router.add_get("/v1/captures/{cid}", get)
        return app

    urls = []
    for i in range(count):
        runner = web.AppRunner(make(i), access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    print(json.dumps(urls), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the parent closes stdin


# --- child: the coordinator ----------------------------------------------------------------------

async def _coordinator(cfg: dict) -> None:
    import aiohttp
    from aiohttp import web

    from gpulens.capture.coordinator import (AgentFleet, Coordinator, CoordinatorSettings, DeadlinePolicy, FanoutSettings,
                                     LocalDiscovery, make_app)
    from gpulens.capture.wire.auth import Credentials, SecretFile

    class Table:
        def for_node(self, node: str, node_ip: str = "") -> str | None:
            return cfg["table"].get(node)

    from gpulens.ground.logs import setup_logging
    setup_logging("error", open(os.devnull, "w"))
    token = Path(cfg["token_file"])
    settings = CoordinatorSettings(
        job_id="train", attempt=0, namespace="ml", archive_root=cfg["archive_root"],
        deadlines=DeadlinePolicy(start_delay_s=START_DELAY_S, dispatch_s=1.0, write_s=0.5, write_per_window=0.0,
                                 archive_s=1.0, report_s=2.0),
        fanout=FanoutSettings(poll_interval_s=cfg["poll_interval_s"], quiet_poll_interval_s=cfg["quiet_poll_interval_s"]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=16)) as session:
        c = Coordinator(settings, LocalDiscovery(Path(cfg["registry"]), job_id="train", attempt=0, namespace="ml",
                                                 agents=Table()),
                        AgentFleet(session, SecretFile(token)))
        runner = web.AppRunner(make_app(c, Credentials(tokens=(SecretFile(token),))), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", cfg["port"]).start()
        print("ready", flush=True)
        await stop.wait()
        await runner.cleanup()


# --- parent ---------------------------------------------------------------------------------------

def _vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


class Scenario:
    def __init__(self, name: str, targets: int, agents: int, black_hole: int | None, root: Path, poll: float,
                 quiet_poll: float = 3.0):
        from tests.conftest import free_port
        self.name, self.targets, self.agents, self.black_hole = name, targets, agents, black_hole
        self.dir = root / name
        self.registry = self.dir / "registry"
        self.registry.mkdir(parents=True)
        self.token = self.dir / "token"
        self.token.write_text(TOKEN)
        self.port, self.poll, self.quiet_poll = free_port(), poll, quiet_poll
        self.url = f"http://127.0.0.1:{self.port}"
        self.latencies: list[float] = []
        self.cpu: list[float] = []
        self.healthy_done: list[float] = []

    def start(self) -> None:
        self.agent_proc = subprocess.Popen([sys.executable, __file__, "_agents", str(self.agents),
                                            str(-1 if self.black_hole is None else self.black_hole)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        urls = json.loads(self.agent_proc.stdout.readline())
        per_agent = self.targets // self.agents
        lws = max(1, per_agent // 2)
        rank = 0
        for a in range(self.agents):
            for p in range(per_agent // lws):
                for local in range(lws):
                    rec = {"schema_version": 1, "job_id": "train", "attempt": 0, "namespace": "ml", "pod": f"train-{a}-{p}",
                           "pod_uid": f"u-{a}-{p}", "container": "c", "node": f"node-{a}", "global_rank": rank,
                           "local_rank": local, "world_size": self.targets, "local_world_size": lws, "pid": 100 + local,
                           "pid_namespace": f"pid:[{a}{p}]", "kineto_job_id": 1, "start_time": time.time(),
                           "trace_dir": "/t", "socket_dir": "/s"}
                    (self.registry / f"train__a0__r{rank}.json").write_text(json.dumps(rec))
                    rank += 1
        cfg = {"registry": str(self.registry), "table": {f"node-{a}": u for a, u in enumerate(urls)},
               "archive_root": f"file://{self.dir / 'archive'}", "token_file": str(self.token), "port": self.port,
               "poll_interval_s": self.poll, "quiet_poll_interval_s": self.quiet_poll}
        self.coord = subprocess.Popen([sys.executable, __file__, "_coordinator", json.dumps(cfg)],
                                      stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.coord.stdout.readline().strip() == "ready"
        self.idle_rss = _vm(self.coord.pid, "VmRSS")

    async def run_once(self, http, window_ms: int) -> None:
        h = {"Authorization": f"Bearer {TOKEN}"}
        cpu0 = _cpu(self.coord.pid)
        async with http.post(self.url + "/v1/captures", json={"job_id": "train", "duration_ms": window_ms}, headers=h) as r:
            cid = (await r.json())["capture_id"]
        while True:
            await asyncio.sleep(0.2)
            async with http.get(self.url + "/v1/captures", headers=h) as r:
                summary = next(c for c in (await r.json())["captures"] if c["capture_id"] == cid)
            if summary["phase"] in ("converged", "failed"):
                break
        async with http.get(self.url + f"/v1/captures/{cid}", headers=h) as r:
            status = await r.json()
        assert status["phase"] == "converged", status
        self.cpu.append(_cpu(self.coord.pid) - cpu0)
        window_end = status["requested_at"] + START_DELAY_S + _jitter(cid) + window_ms / 1000
        self.latencies.append(status["manifest_written_at"] - window_end)
        archived = [t for t in status["targets"] if t["state"] == "archived"]
        expected = self.targets - (self.targets // self.agents if self.black_hole is not None else 0)
        assert len(archived) == expected, (len(archived), expected)
        self.healthy_done.append(max(t["updated_at"] for t in archived) - window_end)

    def stop(self) -> None:
        self.peak_rss = _vm(self.coord.pid, "VmHWM")
        self.coord.send_signal(signal.SIGTERM)
        self.coord.wait(30)
        self.agent_proc.stdin.close()
        self.agent_proc.terminate()
        self.agent_proc.wait(30)


async def _main(args: argparse.Namespace) -> None:
    import aiohttp

    with tempfile.TemporaryDirectory(prefix="gl-bench-coord-") as tmp:
        root = Path(tmp)
        scenarios = [Scenario("baseline_20_on_1", 20, 1, None, root, args.poll_interval_s),
                     Scenario("1000_on_50", 1000, 50, None, root, args.poll_interval_s),
                     Scenario("1000_on_50_one_dead", 1000, 50, 7, root, args.poll_interval_s)]
        if args.compare_quiet:
            scenarios.append(Scenario("1000_on_50_no_quiet_polling", 1000, 50, None, root, args.poll_interval_s,
                                      quiet_poll=args.poll_interval_s))
        for s in scenarios:
            s.start()
        try:
            async with aiohttp.ClientSession() as http:
                for i in range(args.runs):
                    for s in scenarios:
                        await s.run_once(http, args.window_ms)
                    print(f"run {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
        finally:
            for s in scenarios:
                s.stop()
    base = statistics.median(scenarios[0].latencies)
    print(f"\nwindow {args.window_ms} ms, start delay {START_DELAY_S} s, poll interval {args.poll_interval_s} s, "
          f"{args.runs} interleaved runs, medians\n")
    print("| scenario | window end -> converged (manifest written) | vs baseline | window end -> last healthy target archived | "
          "coordinator CPU per capture | idle RSS | peak RSS (VmHWM) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in scenarios:
        lat = statistics.median(s.latencies)
        print(f"| {s.name} | {lat:.2f} s | {lat / base:.2f}x | {statistics.median(s.healthy_done):.2f} s | "
              f"{statistics.median(s.cpu):.2f} s | {s.idle_rss:.0f} MiB | {s.peak_rss:.0f} MiB |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_agents":
        bh = int(sys.argv[3])
        asyncio.run(_agents(int(sys.argv[2]), None if bh < 0 else bh))
    elif len(sys.argv) > 1 and sys.argv[1] == "_coordinator":
        asyncio.run(_coordinator(json.loads(sys.argv[2])))
    else:
        p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        p.add_argument("--runs", type=int, default=5)
        p.add_argument("--window-ms", type=int, default=2000)
        p.add_argument("--poll-interval-s", type=float, default=1.0)
        p.add_argument("--compare-quiet", action="store_true",
                       help="add 1000/50 polled every --poll-interval-s from the start (no slower polls while warming up)")
        p.add_argument("--start-delay-s", type=float, default=START_DELAY_S,
                       help="simulated dispatch -> trace start delay (and the coordinator's allowance for it)")
        a = p.parse_args()
        os.environ["GPULENS_BENCH_START_DELAY_S"] = str(a.start_delay_s)   # the children read it
        START_DELAY_S = a.start_delay_s
        asyncio.run(_main(a))
