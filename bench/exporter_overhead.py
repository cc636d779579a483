"""Exporter costs on the CUDA stand-in, measured side by side in one run (medians).

1. Cost per probed launch: the same launch loop (kernel time 0, so the loop is launch-bound at
   10^5-10^6 launches/s) with no probe, with an empty probe (the uprobe alone) and with gpulens's
   probes, interleaved round by round.
2. Exporter CPU while a workload launches flat out and Prometheus scrapes every second: the
   `gpulens exporter` process's own CPU time (the probes' cost is charged to the workload, in 1).
3. Scrape and discovery time with N live processes in the map, each its own pod: the old scrape
   (collect and encode per request) next to the cached one (exporter/exposition.py: bytes the
   tick encoded), interleaved, and what the encoding at the tick costs.

Needs root, bcc and gcc. Usage: sudo .venv/bin/python bench/exporter_overhead.py [--rounds 5] [--procs 1000]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import random
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpulens.exporter.config import ExporterConfig  # noqa: E402
from gpulens.exporter.probes import DriverProbes  # noqa: E402
from gpulens.exporter.service import Exporter  # noqa: E402
from gpulens.exporter.stub import build_stub  # noqa: E402


class _ProgInfo(ctypes.Structure):
    """struct bpf_prog_info up to run_cnt (uapi/linux/bpf.h)."""
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32), ("nr_map_ids", ctypes.c_uint32),
                ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32),
                ("gpl_compatible", ctypes.c_uint32), ("netns_dev", ctypes.c_uint64), ("netns_ino", ctypes.c_uint64),
                ("nr_jited_ksyms", ctypes.c_uint32), ("nr_jited_func_lens", ctypes.c_uint32),
                ("jited_ksyms", ctypes.c_uint64), ("jited_func_lens", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
                ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
                ("nr_func_info", ctypes.c_uint32), ("nr_line_info", ctypes.c_uint32), ("line_info", ctypes.c_uint64),
                ("jited_line_info", ctypes.c_uint64), ("nr_jited_line_info", ctypes.c_uint32),
                ("line_info_rec_size", ctypes.c_uint32), ("jited_line_info_rec_size", ctypes.c_uint32),
                ("nr_prog_tags", ctypes.c_uint32), ("prog_tags", ctypes.c_uint64), ("run_time_ns", ctypes.c_uint64),
                ("run_cnt", ctypes.c_uint64)]


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) the kernel accounts to a BPF program while kernel.bpf_stats_enabled=1."""
    info = _ProgInfo()
    attr = (ctypes.c_uint32 * 4)(fd, ctypes.sizeof(info), ctypes.addressof(info) & 0xFFFFFFFF, ctypes.addressof(info) >> 32)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(321), ctypes.c_long(15), attr, ctypes.c_uint(16)) != 0:   # BPF_OBJ_GET_INFO_BY_FD
        raise OSError(ctypes.get_errno(), "BPF_OBJ_GET_INFO_BY_FD")
    return info.run_time_ns, info.run_cnt


def launch_loop(stub, lib: Path, launches: int) -> float:
    """Seconds the workload spent in a launch-only loop of `launches` cuLaunchKernel calls."""
    out = subprocess.run([str(stub.workload), "--lib", str(lib), "--steps", str(launches // 1000), "--kernels", "1000",
                          "--sync-every", "0"], capture_output=True, text=True, check=True, env=stub.env())
    return json.loads(out.stdout.splitlines()[-1])["wall_seconds"]


def attach(probes: DriverProbes, lib: Path) -> None:
    st = os.stat(lib)
    result = probes.attach((st.st_dev, st.st_ino), str(lib))
    assert result.attached and not result.errors, result


def per_call_cost(stub, lib: Path, rounds: int, launches: int) -> dict:
    full, empty = DriverProbes(max_processes=1024, max_inflight=1024), DriverProbes(empty=True)
    key = (os.stat(lib).st_dev, os.stat(lib).st_ino)
    samples: dict[str, list[float]] = {"none": [], "empty": [], "gpulens": []}
    launch_loop(stub, lib, 10_000)                                     # warm caches
    handler_ns: list[float] = []
    stats_file = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_was = stats_file.read_text().strip() if stats_file.exists() else None
    if stats_was is not None:
        stats_file.write_text("1")            # the kernel then times every BPF program run
    rng = random.Random(1)
    for _ in range(rounds):
        order = ["none", "empty", "gpulens"]
        rng.shuffle(order)                      # no configuration always runs first or last
        for config in order:
            if config == "none":
                samples["none"].append(launch_loop(stub, lib, launches))
            elif config == "empty":
                attach(empty, lib)
                samples["empty"].append(launch_loop(stub, lib, launches))
                empty.detach(key)
            else:
                attach(full, lib)
                fd = full._funcs[("on_entry", 48)] if full.multi_links else None
                before = prog_run_stats(fd) if fd is not None else (0, 0)
                samples["gpulens"].append(launch_loop(stub, lib, launches))
                if fd is not None:
                    after = prog_run_stats(fd)
                    handler_ns.append((after[0] - before[0]) / max(1, after[1] - before[1]))
                counted = sum(c.launches for c in full.read())
                full.detach(key)
                full.forget([c.key for c in full.read()])
                assert counted == launches, (counted, launches)     # every launch was counted
    full.close()
    empty.close()
    if stats_was is not None:
        stats_file.write_text(stats_was)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "launches_per_run": launches,
        "rounds": rounds,
        "rate_per_s": {k: round(launches / v) for k, v in med.items()},
        "ns_per_call": {k: round(v / launches * 1e9, 1) for k, v in med.items()},
        "probe_cost_ns": round((med["gpulens"] - med["none"]) / launches * 1e9, 1),
        "uprobe_trap_ns": round((med["empty"] - med["none"]) / launches * 1e9, 1),
        "bpf_handler_ns_kernel_stats": round(statistics.median(handler_ns), 1) if handler_ns else None,
        "wall_ratio_gpulens_vs_none": round(med["gpulens"] / med["none"], 2),
        "wall_ratio_gpulens_vs_empty": round(med["gpulens"] / med["empty"], 3),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gauge(url: str, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    for fam in text_string_to_metric_families(text):
        if fam.name == name and fam.samples:
            return fam.samples[0].value
    return None


def exporter_cpu(stub, lib: Path, seconds: float) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exe = REPO / ".venv" / "bin" / "gpulens"
    proc = subprocess.Popen([str(exe), "exporter", "--listen", f"127.0.0.1:{port}", "--nvml", "off",
                             "--library-glob", glob.escape(str(lib))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = subprocess.Popen([str(stub.workload), "--lib", str(lib), "--wait-stdin", "--duration", str(seconds + 5),
                             "--kernels", "1000", "--sync-every", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=stub.env())
    try:
        work.stdout.readline()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _gauge(url, "gpulens_exporter_libraries_attached") != 1:
            time.sleep(0.2)
        work.stdin.write("go\n")
        work.stdin.flush()
        time.sleep(1.0)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        scrapes = []
        while time.monotonic() - t0 < seconds:
            s = time.perf_counter()
            urllib.request.urlopen(url, timeout=10).read()
            scrapes.append(time.perf_counter() - s)
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - s)))
        cpu1, t1 = _cpu_seconds(proc.pid), time.monotonic()
        rep = json.loads(work.communicate("x\n", timeout=60)[0].splitlines()[-1])
        return {"seconds": round(t1 - t0, 1), "workload_launch_rate_per_s": round(rep["launches"] / rep["wall_seconds"]),
                "exporter_cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / (t1 - t0), 2),
                "scrape_ms_median": round(1000 * statistics.median(scrapes), 2), "scrapes": len(scrapes)}
    finally:
        for p in (work, proc):
            if p.poll() is None:
                p.kill()
            p.wait(10)


def many_processes(stub, lib: Path, n: int, scrapes: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * n + 256)), hard))
    tmp = Path(tempfile.mkdtemp(prefix="gpulens-bench-"))
    reg = tmp / "registry"
    reg.mkdir()
    cfg = ExporterConfig(node="bench", library_globs=(glob.escape(str(lib)),), nvml="off",
                         registry_dir=reg, max_processes=max(16384, 2 * n))
    exp = Exporter(cfg)
    exp.start()
    procs = []
    try:
        for i in range(n):
            p = subprocess.Popen([str(stub.workload), "--lib", str(lib), "--wait-stdin", "--steps", "1", "--kernels", "10",
                                  "--h2d-bytes", "64", "--sync-every", "1"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=stub.env())
            procs.append(p)
        pidns = os.readlink("/proc/self/ns/pid")
        for i, p in enumerate(procs):
            assert p.stdout.readline().startswith("ready")
            (reg / f"bench__a0__r{i}__ns0__p{p.pid}.json").write_text(json.dumps({
                "namespace": "bench", "pod": f"pod-{i:04d}", "container": "c", "pid": p.pid, "host_pid": p.pid,
                "pid_namespace": pidns, "start_time": time.time()}))
        while not exp.probes.libraries:
            exp.tick()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            p.stdout.readline()                 # report: its calls are done, it now waits
        ticks = []
        for _ in range(5):
            s = time.perf_counter()
            exp.tick()                          # discovery, then (no scrapes seen yet) the encoding
            ticks.append(time.perf_counter() - s)
        # Side by side, interleaved: the old scrape (collect + encode per request) and the new
        # one (the bytes the tick encoded), each as the HTTP handler calls it, plus gzip.
        from prometheus_client import generate_latest
        old, new, new_gz, encode_at_tick, size = [], [], [], [], 0
        for _ in range(scrapes):
            s = time.perf_counter()
            body = generate_latest(exp.registry)
            old.append(time.perf_counter() - s)
            size = len(body)
            s = time.perf_counter()
            exp.exposition.refresh(force=True)
            encode_at_tick.append(time.perf_counter() - s)
            s = time.perf_counter()
            cached = exp.exposition.body("", False)
            new.append(time.perf_counter() - s)
            s = time.perf_counter()
            exp.exposition.body("", True)
            new_gz.append(time.perf_counter() - s)
            assert len(cached.data) > 0.9 * size
        times = old
        series = sum(1 for k in exp.ledger.totals() if k.namespace == "bench")
        assert series == n, (series, n)
        med = lambda xs: round(1000 * statistics.median(xs), 2)  # noqa: E731
        return {"processes": n, "series": series, "scrape_ms_median_collect_and_encode": med(times),
                "scrape_ms_median_cached": med(new), "scrape_ms_median_cached_gzip": med(new_gz),
                "scrape_speedup": round(statistics.median(times) / statistics.median(new), 1),
                "encode_at_tick_ms_median": med(encode_at_tick), "scrape_bytes": size,
                "tick_ms_median": med(ticks)}
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        exp.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=200_000)
    ap.add_argument("--cpu-seconds", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--parts", nargs="+", default=["per_call", "exporter_cpu", "many_processes"],
                    choices=["per_call", "exporter_cpu", "many_processes"])
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (eBPF)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="gpulens-bench-lib-"))
    try:
        stub = build_stub()
        # A name other exporters' default glob (libcuda.so*) does not match, so no other exporter
        # running on this machine probes the benchmark's library.
        lib = tmp / "libgpulens-bench-cuda.so.1"
        shutil.copy2(stub.libcuda, lib)
        parts = {"per_call": lambda: per_call_cost(stub, lib, args.rounds, args.launches),
                 "exporter_cpu": lambda: exporter_cpu(stub, lib, args.cpu_seconds),
                 "many_processes": lambda: many_processes(stub, lib, args.procs, args.scrapes)}
        results = {name: parts[name]() for name in args.parts}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
