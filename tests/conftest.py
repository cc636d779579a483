"""Shared pytest fixtures for every test tier (unit, integration with real components, e2e)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
VENV_BIN = Path(sys.executable).parent


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
        pytest.skip(f"shared trace data not found at {path}")
    return path


@pytest.fixture(scope="session")
def gpulens_bin() -> str:
    exe = VENV_BIN / "gpulens"
    return str(exe) if exe.exists() else shutil.which("gpulens") or "gpulens"


def is_root() -> bool:
    return os.geteuid() == 0
