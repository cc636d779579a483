"""The packages of the one `gpulens` namespace: every folder below each root that pyproject.toml's
[tool.setuptools.package-dir] maps (pyproject alone cannot find packages across mapped folders).
Everything else about the distribution is in pyproject.toml."""

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).resolve().parent
ROOTS: dict[str, str] = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def packages() -> list[str]:
    found = set(ROOTS)
    for name, folder in ROOTS.items():
        found.update(f"{name}.{sub}" for sub in find_namespace_packages(
            str(HERE / folder), exclude=["*__pycache__*", "*.egg-info*"]))
    return sorted(found)


setup(packages=packages())
