"""Time to first photo: from the moment `gpulens up --demo --incident X` induces the incident to
the moment the report link of the capture it caused is on the page, with the milestones between.

    sudo .venv/bin/python bench/up_time_to_photo.py [--incident host_sync] [--runs 3]
    sudo .venv/bin/python bench/up_time_to_photo.py --serving --incident noisy_neighbor   # the serving demo
    sudo .venv/bin/python bench/up_time_to_photo.py --incident hang   # stall -> stalled alert -> hang report

Runs the real tree (needs root for eBPF, Prometheus and Alertmanager installed); prints each
run's milestones and the medians. Alert-rule windows are scaled by `gpulens up`'s default 1/30.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulens.up.command import INCIDENTS  # noqa: E402
from tests.e2e.test_up import free_port_base  # noqa: E402

MILESTONES = [("alert", r"alert firing: \S+ diagnosis=(\S+)"), ("converged", r"capture \S+ \(\S+\): converged"),
              ("report", r"capture \S+: report (\S+)"), ("verdict", r"capture \S+: hang: ")]


def one_run(incident: str, after: float, timeout: float, serving: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        base = free_port_base()
        cmd = [sys.executable, "-m", "gpulens.cli", "up", "--demo", *(["--serving"] if serving else []),
               "--incident", incident, "--incident-after",
               str(after), "--workdir", f"{tmp}/up", "--port-base", str(base), "--status-interval", "0.5"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        t0 = None
        seen: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        try:
            for line in proc.stdout:
                now = time.monotonic()
                if "inducing incident" in line:
                    t0 = now
                for name, pattern in MILESTONES:
                    m = re.search(pattern, line) if name not in seen and t0 is not None else None
                    if m:
                        seen[name] = now - t0
                        if name == "alert":
                            print(f"  diagnosis: {m.group(1)}", flush=True)
                if ("report" in seen and (incident != "hang" or "verdict" in seen)) or now > deadline:
                    break
        finally:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--incident", default="host_sync", choices=INCIDENTS)
    ap.add_argument("--serving", action="store_true", help="the serving demo (two replicas; noisy_neighbor only)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--incident-after", type=float, default=80)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        r = one_run(args.incident, args.incident_after, args.timeout, args.serving)
        runs.append(r)
        print(f"run {i + 1}: " + ", ".join(f"{k} +{v:.1f} s" for k, v in r.items()), flush=True)
    print(f"medians over {args.runs} runs (seconds after the incident starts):")
    for name, _ in MILESTONES:
        vals = [r[name] for r in runs if name in r]
        print(f"  {name:<10} {statistics.median(vals):6.1f} s ({len(vals)}/{len(runs)} runs reached it)" if vals
              else f"  {name:<10} never reached")


if __name__ == "__main__":
    main()
