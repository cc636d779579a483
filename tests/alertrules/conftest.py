"""Fixtures for the alert-rule tests: the real promtool/amtool binaries and a scratch copy of the
rules folder that a test may mutate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from tests.conftest import missing

REPO = Path(__file__).resolve().parents[2]
ALERTRULES = REPO / "alertrules"
PROMTOOL = "/usr/bin/promtool"
AMTOOL = "/usr/bin/amtool"


def need(binary: str) -> str:
    if not Path(binary).exists():
        missing(f"{binary} not installed (scripts/setup.sh installs it)")
    return binary


@pytest.fixture(scope="session")
def promtool() -> str:
    return need(PROMTOOL)


@pytest.fixture(scope="session")
def amtool() -> str:
    return need(AMTOOL)


def run(*cmd: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def rules_copy(tmp_path: Path) -> Path:
    """alertrules/rules and alertrules/tests copied side by side, to mutate without touching the repo."""
    dst = tmp_path / "alertrules"
    shutil.copytree(ALERTRULES / "rules", dst / "rules")
    shutil.copytree(ALERTRULES / "tests", dst / "tests")
    return dst
