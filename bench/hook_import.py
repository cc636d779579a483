"""Interpreter start-up cost added by the trainer hook (goal: under 20 ms).

Runs, interleaved and side by side, `python -c pass` without the hook, with it (env only), and
with a registry dir (the post-import watcher installed; nothing registers without torch); then
`python -c "import torch"` against a stand-in torch (an empty module named torch, so torch's own
seconds of import do not drown the difference) without and with the hook, where the hook writes
the record, installs the signal handlers and removes the record at exit. Prints medians and the
difference.
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
from gpulens.hooks import hook_path  # noqa: E402


def once(env: dict[str, str], code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    n = ap.parse_args().runs
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "PYTHONPATH"))}
    with tempfile.TemporaryDirectory() as reg, tempfile.TemporaryDirectory() as standin:
        Path(standin, "torch").mkdir()
        Path(standin, "torch", "__init__.py").write_text("")
        hooked = dict(base, PYTHONPATH=str(hook_path()))
        armed = dict(base, PYTHONPATH=str(hook_path()), GPULENS_REGISTRY_DIR=reg, GPULENS_JOB_ID="bench")
        variants = {  # name -> (env, code, baseline name)
            "plain": (base, "pass", "plain"),
            "hook (env only)": (hooked, "pass", "plain"),
            "hook + registry dir": (armed, "pass", "plain"),
            "import torch*, plain": (dict(base, PYTHONPATH=standin), "import torch", "import torch*, plain"),
            "import torch*, registered": (dict(armed, PYTHONPATH=f"{hook_path()}{os.pathsep}{standin}"), "import torch",
                                          "import torch*, plain"),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(n):  # interleaved, so drift hits every variant alike
            for name, (env, code, _) in variants.items():
                samples[name].append(once(env, code))
    print(f"python {sys.version.split()[0]}, {n} runs each, interleaved; medians (torch* = stand-in):")
    for name, vals in samples.items():
        med, ref = statistics.median(vals), statistics.median(samples[variants[name][2]])
        print(f"  {name:<26} {med:7.1f} ms   added {med - ref:+6.1f} ms   ratio {med / ref:5.2f}")


if __name__ == "__main__":
    main()
