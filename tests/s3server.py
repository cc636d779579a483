"""A real S3-compatible server (moto in server mode) on 127.0.0.1, and a TCP proxy that can be
switched off and on in front of it (an S3 outage without losing the server's in-memory data)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import free_port

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1)
            return proc, endpoint
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError("moto_server did not start")


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SwitchableProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target>; `down()` stops listening and cuts open
    connections (clients get connection refused, as from a dead endpoint), `up()` listens again."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.connections = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def down(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._conns):
            w.close()

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._conns.update({writer, up_writer})

        async def pipe(r, w):
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns.difference_update({writer, up_writer})
