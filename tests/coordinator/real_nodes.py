"""One node of the real-agent tests: its hostPath folders, its worker process, its `gpulens agent`
(builtin trigger: the agent answers Kineto's IPC socket itself)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from gpulens.hooks import hook_path
from tests.conftest import free_port

from .servers import REPO, GpulensProcess

TRAINER = str(REPO / "tests" / "agent" / "trainer.py")


class Node:
    """One node's hostPath folders, its worker process and its `gpulens agent`."""

    def __init__(self, name: str, base: Path, archive: Path):
        self.name, self.base, self.archive = name, base / name, archive
        self.sock = tempfile.mkdtemp(prefix="gl-", dir="/tmp")      # sun_path: keep it short
        for d in ("reg", "traces", "state"):
            (self.base / d).mkdir(parents=True)
            os.chmod(self.base / d, 0o1777)
        os.chmod(self.sock, 0o777)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trainer: subprocess.Popen | None = None
        self.agent: GpulensProcess | None = None

    def start_trainer(self, rank: int, world: int, stop_file: Path, *, argv: list[str] | None = None,
                      extra_env: dict[str, str] | None = None) -> None:
        """tests/agent/trainer.py by default; `argv` (after the interpreter) runs another script."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
        env.update(PYTHONPATH=str(hook_path()), OMP_NUM_THREADS="1", GPULENS_JOB_ID="train", GPULENS_ATTEMPT="0",
                   GPULENS_NAMESPACE="ml", GPULENS_POD_NAME=f"train-{rank}", GPULENS_POD_UID=f"uid-train-{rank}",
                   GPULENS_NODE_NAME=self.name, GPULENS_CONTAINER_NAME="trainer",
                   GPULENS_REGISTRY_DIR=str(self.base / "reg"), GPULENS_TRACE_DIR=str(self.base / "traces"),
                   GPULENS_SOCKET_DIR=self.sock, RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1", **(extra_env or {}))
        self.log = open(self.base / "trainer.log", "wb")
        self.trainer = subprocess.Popen([sys.executable, *(argv or [TRAINER, str(stop_file), "300"])], env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    async def start_agent(self, token_file: Path) -> None:
        self.agent = await GpulensProcess(
            ["agent", "--listen", f"127.0.0.1:{self.port}", "--node", self.name, "--registry-dir", str(self.base / "reg"),
             "--trace-dir", str(self.base / "traces"), "--state-dir", str(self.base / "state"),
             "--archive-root", f"file://{self.archive}", "--trigger", "builtin", "--socket-dir", self.sock,
             "--token-file", str(token_file)], self.base / "agent.log").start()
        await self.agent.wait_ready(self.url)

    def records(self) -> list[Path]:
        return sorted((self.base / "reg").glob("*.json"))

    async def stop(self) -> None:
        if self.agent:
            await self.agent.stop()
        if self.trainer and self.trainer.poll() is None:
            try:
                await asyncio.to_thread(self.trainer.wait, 20)
            except subprocess.TimeoutExpired:
                os.killpg(self.trainer.pid, signal.SIGKILL)
                self.trainer.wait()
        if self.trainer:
            self.log.close()
        shutil.rmtree(self.sock, ignore_errors=True)
