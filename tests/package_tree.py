"""The sources laid out as they install: the one `gpulens` namespace assembled from the top-level
folders that pyproject.toml's [tool.setuptools.package-dir] maps (the design card's layout).

Tools that find a package by walking one folder (grimp, and so import-linter) see only gpulens/ in
a checkout: the planes live beside it and an editable install maps them at import time. They are
given this copy instead, which is what a wheel holds, without building one."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs(repo: Path = REPO) -> dict[str, str]:
    """Import name -> folder, from pyproject.toml (the one place the mapping is written)."""
    return tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def stage(dest: Path, *, repo: Path = REPO, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")) -> Path:
    """Copy every mapped folder to its import name's place under `dest` (dest/gpulens/capture, ...);
    returns `dest`, the folder to put first on the path."""
    for name, folder in sorted(package_dirs(repo).items()):   # "gpulens" before "gpulens.capture"
        shutil.copytree(repo / folder, dest.joinpath(*name.split(".")), ignore=ignore, dirs_exist_ok=True)
    return dest
