"""Fixtures for the container tests: the real image (built by image/build.sh from the repository's
Dockerfile) and containers run with podman as the chart runs the components (user, capabilities,
read-only root, hostPID, host folders as bind mounts).

Every container gets a unique name and is removed at the end of its test. Under CI=true a machine
that cannot build or run containers is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PODMAN = REPO / "image" / "podman"
BUILD = REPO / "image" / "build.sh"
CI = os.environ.get("CI") == "true"


def podman(*args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """One podman call through image/podman (the project's runtime settings)."""
    done = subprocess.run([str(PODMAN), *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "container tests need root (podman with runc, no user namespaces configured here)"
    return None


@pytest.fixture(scope="session")
def image() -> str:
    """`image/build.sh`: the image name it prints (a warm build is a cache hit)."""
    why = _unusable()
    if why:
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    done = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, f"image/build.sh failed:\n{done.stderr[-6000:]}"
    name = done.stdout.strip().splitlines()[-1]
    assert name.startswith("localhost/gpulens:"), done.stdout
    return name


@dataclass
class Container:
    name: str
    argv: list[str]

    def logs(self) -> str:
        done = podman("logs", self.name, check=False, timeout=60)
        return done.stdout + done.stderr

    def running(self) -> bool:
        done = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False, timeout=60)
        return done.stdout.strip() == "true"

    def inspect(self) -> dict:
        return json.loads(podman("inspect", self.name, timeout=60).stdout)[0]

    def exec(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *cmd, check=False, timeout=timeout)


class Containers:
    """Starts containers (detached, unique names) and removes every one of them afterwards."""

    def __init__(self):
        self.names: list[str] = []

    def name(self, role: str) -> str:
        n = f"gpulens-test-{role}-{uuid.uuid4().hex[:8]}"
        self.names.append(n)
        return n

    def start(self, role: str, image: str, *args: str, run_opts: tuple[str, ...] = ()) -> Container:
        name = self.name(role)
        podman("run", "-d", "--name", name, *run_opts, image, *args, timeout=300)
        return Container(name, list(args))

    def run(self, role: str, image: str, *args: str, run_opts: tuple[str, ...] = (),
            timeout: float = 600) -> subprocess.CompletedProcess:
        """Run to completion (the container is removed afterwards like the others)."""
        name = self.name(role)
        return podman("run", "--name", name, *run_opts, image, *args, check=False, timeout=timeout)

    def remove_all(self) -> None:
        for n in self.names:
            podman("rm", "-f", "-t", "0", n, check=False, timeout=120)


@pytest.fixture
def containers():
    c = Containers()
    yield c
    c.remove_all()


#: The chart's restricted security context (gpulens.restrictedContainerSecurity) as podman flags.
RESTRICTED = ("--user", "65532:65532", "--read-only", "--cap-drop", "ALL",
              "--security-opt", "no-new-privileges", "--tmpfs", "/tmp:rw,size=64m,mode=1777",
              "--network", "host")


def http_get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http(url: str, container: Container, timeout: float = 120.0) -> bytes:
    """Poll `url` until it answers 200; fail early (with the logs) if the container exits."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            status, body = http_get(url, timeout=3)
            if status == 200:
                return body
            last = f"HTTP {status}"
        except OSError as exc:
            last = str(exc)
        if not container.running():
            raise AssertionError(f"{container.name} exited before {url} answered:\n{container.logs()[-4000:]}")
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer 200 in {timeout} s ({last}):\n{container.logs()[-4000:]}")
