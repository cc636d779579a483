"""GPU machine check: the exporter on the real libcuda vs torch.profiler, for one PyTorch CUDA loop.

A child process runs a small training-like loop (cuBLAS matmul, ATen elementwise kernels, a
reduction, `.item()` every 10 steps) under torch.profiler, then the same loop again without the
profiler, then CUDA graphs: a graph captured before the exporter attached is replayed (its kernels
must count as unknown), the loop body is captured into a new graph while probed (the captured
launches must not count as launches) and replayed under torch.profiler (the graph kernels the
probes count vs the profiler's kernels). The exporter (in this process, real probes on every
mapped libcuda.so*) counts the child's calls; the check compares:

- kernel launches counted by the probes vs GPU kernels in the profiler trace (the §1.5 question
  of reference/ebpf-gpu-signals.md: do runtime launches reach the exported driver symbols?),
- launches with and without the profiler attached (CUPTI must not change what is counted),
- blocking calls vs `.item()` + synchronize calls, D2H bytes vs the profiler's DtoH copies,
- graph launches vs replays, graph kernels vs the profiler's kernels in the replays, launches
  during capture (0), and NVML's view (the child is on one GPU, one pod).

Exits 0 and prints "SKIP: ..." when there is no CUDA GPU, no root or no usable eBPF, so it can
run anywhere. Otherwise prints one JSON document and exits 0 when the launch counts agree within
--tolerance, 1 when they do not. Usage: sudo .venv/bin/python bench/exporter_gpu_check.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(steps: int, size: int, trace_path: str, graph_steps: int = 10, graph_replays: int = 20) -> int:
    """The PyTorch loop (runs in its own process, so the exporter's discovery sees it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def loop(n: int) -> tuple[int, int]:
        items = syncs = 0
        for i in range(n):
            y = torch.relu(x @ x)          # cuBLAS GEMM + an ATen elementwise kernel
            s = y.sum()                    # reduction kernel
            if i % 10 == 0:
                s.item()                   # D2H copy + stream sync
                items += 1
        torch.cuda.synchronize()
        syncs += 1
        return items, syncs

    x = torch.randn(size, size, device="cuda")
    for _ in range(5):                     # warm up: cuBLAS handles, module loading, allocator
        torch.relu(x @ x).sum().item()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    static = torch.zeros(size, size, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            static.copy_(torch.relu(x @ x))
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        static.copy_(torch.relu(x @ x))
    torch.cuda.synchronize()
    print(json.dumps({"phase": "ready", "device": torch.cuda.current_device(),
                      "name": torch.cuda.get_device_name()}), flush=True)

    sys.stdin.readline()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        items, syncs = loop(steps)
    prof.export_chrome_trace(trace_path)
    print(json.dumps({"phase": "profiled", "items": items, "syncs": syncs}), flush=True)

    sys.stdin.readline()
    items2, syncs2 = loop(steps)
    print(json.dumps({"phase": "plain", "items": items2, "syncs": syncs2}), flush=True)

    sys.stdin.readline()
    replays = 50
    for _ in range(replays):
        g.replay()                          # captured before the exporter attached: unknown size
    torch.cuda.synchronize()
    print(json.dumps({"phase": "graphs_early", "replays": replays}), flush=True)

    sys.stdin.readline()                    # capture the loop body, probed: nothing runs
    g2 = torch.cuda.CUDAGraph()
    out = torch.zeros((), device="cuda")
    with torch.cuda.graph(g2):
        for _ in range(graph_steps):
            out.copy_(torch.relu(static @ static).sum())
    torch.cuda.synchronize()
    print(json.dumps({"phase": "capture", "steps": graph_steps}), flush=True)

    sys.stdin.readline()                    # replay it under the profiler: kernels to compare
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(graph_replays):
            g2.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path + ".graphs.json")
    print(json.dumps({"phase": "graphs", "replays": graph_replays}), flush=True)
    sys.stdin.readline()
    return 0


def trace_counts(path: str) -> dict:
    """Counts from a Kineto chrome trace: GPU kernels, runtime/driver launch calls, DtoH copies."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launch_api = [e for e in events if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    names: dict[str, int] = {}
    for e in launch_api:
        names[e["name"]] = names.get(e["name"], 0) + 1
    d2h = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    return {"gpu_kernels": len(kernels), "api_calls": names, "dtoh_copies": len(d2h),
            "dtoh_bytes": sum(int(e.get("args", {}).get("bytes", 0)) for e in d2h)}


def skip(reason: str) -> int:
    print(f"SKIP: {reason}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tolerance", type=float, default=0.01, help="allowed relative launch-count difference")
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.steps, args.size, args.trace)

    try:
        import torch
    except ImportError:
        return skip("torch is not installed")
    if not torch.cuda.is_available():
        return skip("no CUDA GPU (torch.cuda.is_available() is False)")
    if os.geteuid() != 0:
        return skip("needs root for eBPF")
    sys.path.insert(0, str(REPO))
    from gpulens.exporter.config import ExporterConfig
    from gpulens.exporter.service import Exporter

    tmp = Path(tempfile.mkdtemp(prefix="gpulens-gpu-check-"))
    reg = tmp / "registry"
    reg.mkdir()
    exp = Exporter(ExporterConfig(node=os.uname().nodename, registry_dir=reg, nvml="auto", scan_interval_s=0.5,
                                  rescan_interval_s=1.0))
    exp.start()
    if exp.probes is None:
        exp.close()
        return skip(f"eBPF unavailable: {exp.health['ebpf'].view()[1]}")
    trace = str(tmp / "trace.json")
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--steps", str(args.steps), "--size", str(args.size),
                             "--trace", trace], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result: dict = {}
    try:
        ready = json.loads(proc.stdout.readline())
        (reg / f"gpucheck__a0__r0__ns0__p{proc.pid}.json").write_text(json.dumps({
            "namespace": "gpu-check", "pod": "torch-loop", "container": "", "pid": proc.pid, "host_pid": proc.pid,
            "pid_namespace": os.readlink(f"/proc/{proc.pid}/ns/pid"), "start_time": time.time()}))
        deadline = time.monotonic() + 60
        while not exp.probes.libraries and time.monotonic() < deadline:   # the child has mapped libcuda
            exp.tick()
            time.sleep(0.5)
        if not exp.probes.libraries:
            raise SystemExit(f"no driver library attached: {exp.health['ebpf'].view()[1]}")
        libraries = {k: p for k, p in exp.probes.attachment_paths().items()}

        def totals():
            exp.tick()
            mine = [t for k, t in exp.ledger.totals().items() if k.pod == "torch-loop"]
            keys = [k for k in exp.ledger.totals() if k.pod == "torch-loop"]
            f = ("launches", "graph_launches", "graph_kernels", "graph_unknown", "sync_calls", "sync_seconds",
                 "d2h_bytes", "d2h_calls", "h2d_bytes")
            return {n: sum(getattr(t, n) for t in mine) for n in f}, [k.gpu for k in keys]

        def phase(expect: str) -> tuple[dict, dict]:
            before, _ = totals()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            info = json.loads(proc.stdout.readline())
            assert info["phase"] == expect, info
            deadline = time.monotonic() + 20     # its labels settle once NVML lists it (or after the grace)
            after, gpus = totals()
            while not gpus and time.monotonic() < deadline:
                time.sleep(0.5)
                after, gpus = totals()
            return info, {k: after[k] - before[k] for k in after} | {"gpu_labels": gpus}

        prof_info, prof_delta = phase("profiled")
        plain_info, plain_delta = phase("plain")
        early_info, early_delta = phase("graphs_early")
        capture_info, capture_delta = phase("capture")
        graph_info, graph_delta = phase("graphs")
        counts = trace_counts(trace)
        graph_kernels = trace_counts(trace + ".graphs.json")["gpu_kernels"]
        graphs_agree = graph_kernels > 0 and abs(graph_delta["graph_kernels"] - graph_kernels) <= \
            args.tolerance * graph_kernels
        data = exp.scrape_data()
        launches = prof_delta["launches"]
        kernels = counts["gpu_kernels"]
        agree = kernels > 0 and abs(launches - kernels) <= args.tolerance * kernels
        result = {
            "device": ready, "libraries_probed": list(libraries.values()), "steps": args.steps,
            "profiled": {"exporter": prof_delta, "profiler": counts, "child": prof_info},
            "plain": {"exporter": plain_delta, "child": plain_info},
            "graphs_early": {"exporter": early_delta, "child": early_info},
            "capture": {"exporter": capture_delta, "child": capture_info},
            "graphs": {"exporter": graph_delta, "child": graph_info, "profiler_kernels": graph_kernels},
            "nvml": {"gpu_pods": data.gpu_pods, "gpu_processes": data.gpu_processes,
                     "state": exp.health["nvml"].view()[:2]},
            "launches_vs_kernels": {"exporter_launches": launches, "profiler_kernels": kernels,
                                    "ratio": round(launches / kernels, 4) if kernels else None},
            "launches_with_vs_without_profiler": [launches, plain_delta["launches"]],
            "syncs_vs_items": [prof_delta["sync_calls"], prof_info["items"] + prof_info["syncs"]],
            "graph_launches_vs_replays": [graph_delta["graph_launches"], graph_info["replays"]],
            "graph_kernels_vs_profiler_kernels": [graph_delta["graph_kernels"], graph_kernels],
            "launches_during_capture": capture_delta["launches"],
            "early_graph_unknown_vs_replays": [early_delta["graph_unknown"], early_info["replays"]],
            "verdict": "PASS" if agree and graphs_agree and capture_delta["launches"] == 0 else "FAIL",
        }
    finally:
        if proc.poll() is None:
            try:
                proc.stdin.write("exit\n")
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        exp.close()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result.get("verdict") == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
