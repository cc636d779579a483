"""Shared pytest fixtures for every test tier (unit, integration with real components, e2e)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

#: the lanes the suite runs in side by side under xdist (scripts/test.sh; tests/lanes.py says why)
pytest_plugins = ["tests.lanes"]

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
VENV_BIN = Path(sys.executable).parent


#: CI runs on a fresh clone with scripts/setup.sh's components installed: there a missing one is
#: a broken install, which must fail, not pass green with skips.
CI = os.environ.get("CI") == "true"


def missing(reason: str):
    """A required real component (root, bcc, Prometheus, Chromium, shared traces, ...) is missing:
    skip on a developer's machine, FAIL with the reason under CI=true."""
    if CI:
        pytest.fail(f"CI=true: required component missing: {reason}", pytrace=False)
    pytest.skip(reason)


def requires(reason: str | None) -> pytest.MarkDecorator:
    """Marker form of missing(): `@requires(None if present else "why")`, checked at test setup."""
    return pytest.mark.gpulens_requires(reason)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpulens_requires(reason): a required real component is missing "
                                       "when reason is set (skip locally, failure under CI=true)")


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("gpulens_requires"):
        if mark.args and mark.args[0]:
            missing(str(mark.args[0]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    path = SHARED / "data" / "traces"
    if not path.is_dir():
        missing(f"shared trace data not found at {path}")
    return path


@pytest.fixture(scope="session")
def gpulens_bin() -> str:
    exe = VENV_BIN / "gpulens"
    return str(exe) if exe.exists() else shutil.which("gpulens") or "gpulens"


def is_root() -> bool:
    return os.geteuid() == 0
