"""Interpreter start-up cost added by the trainer hook (goal: under 20 ms).

Runs `python -c pass` alternately without and with the hook on PYTHONPATH (and with a registry
dir, so a record is written and removed), side by side, and prints medians and the difference.
    .venv/bin/python bench/hook_import.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hooks import hook_path  # noqa: E402


def once(env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    n = ap.parse_args().runs
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "PYTHONPATH"))}
    with tempfile.TemporaryDirectory() as reg:
        variants = {
            "plain": base,
            "hook (env only)": dict(base, PYTHONPATH=str(hook_path())),
            "hook + registration": dict(base, PYTHONPATH=str(hook_path()), GPULENS_REGISTRY_DIR=reg, GPULENS_JOB_ID="bench"),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(n):  # interleaved, so drift hits every variant alike
            for name, env in variants.items():
                samples[name].append(once(env))
    plain = statistics.median(samples["plain"])
    print(f"python {sys.version.split()[0]}, {n} runs each, interleaved; medians:")
    for name, vals in samples.items():
        med = statistics.median(vals)
        print(f"  {name:<22} {med:7.1f} ms   added {med - plain:+6.1f} ms   ratio {med / plain:5.2f}")


if __name__ == "__main__":
    main()
