"""A virtual environment with the third-party launchers (accelerate, DeepSpeed) for the hook tests.

Built lazily on first use under `.gl/launchers/` (git-ignored) and reused while its pins are
unchanged. It sees the project venv's packages through a .pth line, so torch stays the pinned CPU
build; the launchers are installed without build isolation (DeepSpeed is an sdist whose build
imports torch: isolation would fetch a CUDA torch) and with DS_BUILD_OPS=0 (pure Python).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".gl" / "launchers"
REQUIREMENTS = Path(__file__).with_name("launchers-requirements.txt")


def _site_dirs() -> list[str]:
    dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    return list(dict.fromkeys(dirs + site.getsitepackages()))


def launchers_venv() -> Path:
    """The venv's bin folder (accelerate, deepspeed, python); raises if it cannot be built."""
    want = hashlib.sha256(REQUIREMENTS.read_bytes() + "\n".join(_site_dirs()).encode()).hexdigest()[:16]
    stamp = VENV / ".stamp"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / "launchers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist or two sessions: build once
        if stamp.exists() and stamp.read_text() == want:
            return VENV / "bin"
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        purelib = subprocess.run([str(VENV / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        Path(purelib, "zz_gpulens_base.pth").write_text("\n".join(_site_dirs()) + "\n")
        env = dict(os.environ, DS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
        pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["wheel==0.48.0", "setuptools==84.2.1"], check=True, env=env)
        subprocess.run(pip + ["--no-build-isolation", "-r", str(REQUIREMENTS)], check=True, env=env)
        out = subprocess.run([str(VENV / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                             check=True, capture_output=True, text=True, env=env).stdout.strip()
        if "+cpu" not in out:
            raise RuntimeError(f"the launchers venv got torch {out}, not the CPU build")
        stamp.write_text(want)
        return VENV / "bin"
