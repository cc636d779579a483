"""Fixtures for the node agent tests: the dynolog double, a Kineto-side IPC poller, trace files."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.doubles.dynolog_double import DynologDouble


@pytest.fixture
def sock_dir():
    """A short folder for AF_UNIX sockets (sun_path holds 108 bytes; pytest's tmp_path is long)."""
    d = tempfile.mkdtemp(prefix="gl-", dir="/tmp")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def double(sock_dir):
    d = DynologDouble(socket_dir=sock_dir)
    await d.start()
    yield d
    await d.stop()


#: How long Kineto waits for an answer to a poll (IpcFabricConfigClient.cpp: 5 tries, 10 ms apart).
KINETO_ANSWER_WAIT_S = 0.05


class KinetoPoller:
    """Stands for Kineto's IpcFabricConfigClient: binds `dynoconfigclient<uuid>` (abstract with a
    trailing NUL, or `<dir>/dynoconfigclient<uuid>`), sends `req` datagrams (40-byte header
    `<Q32s` + `<iiq` + n x `<i`) and reads the answer, as kineto's IpcFabricConfigClient.cpp does."""

    def __init__(self, socket_dir: str | None, job: int, pids: list[int], server: str | bytes | None = None):
        self.name = f"dynoconfigclient{uuid.uuid4()}"
        self.addr = os.path.join(socket_dir, self.name) if socket_dir else b"\0" + self.name.encode() + b"\0"
        self.server = server or (os.path.join(socket_dir, "dynolog") if socket_dir else b"\0dynolog\0")
        self.job, self.pids = job, pids
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.addr)
        self.sock.settimeout(2.0)

    def raw(self, datagram: bytes, timeout: float = 2.0) -> bytes | None:
        self.sock.settimeout(timeout)
        self.sock.sendto(datagram, self.server)
        try:
            return self.sock.recv(1 << 16)
        except socket.timeout:
            return None

    def raw_quiet(self, datagram: bytes) -> bytes | None:
        """raw() for datagrams that should get no answer: a short wait is enough (replies take ~ms)."""
        return self.raw(datagram, 0.5)

    def request(self, config_type: int = 3) -> bytes:
        payload = struct.pack("<iiq", config_type, len(self.pids), self.job) + struct.pack(f"<{len(self.pids)}i", *self.pids)
        return struct.pack("<Q32s", len(payload), b"req") + payload

    def send_poll(self, config_type: int = 3) -> None:
        """Send a poll and read nothing: a poll Kineto gave up waiting for."""
        self.sock.sendto(self.request(config_type), self.server)

    def queued_answers(self) -> int:
        """Datagrams waiting in this client's socket (read and dropped): what Kineto would take
        for the answers to its next polls."""
        n = 0
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(1 << 16)
                n += 1
        except BlockingIOError:
            return n
        finally:
            self.sock.setblocking(True)

    def poll(self, config_type: int = 3, timeout: float = 2.0) -> str | None:
        """One poll; returns the config text ('' when nothing is pending), None when unanswered.
        Kineto itself waits 50 ms (KINETO_ANSWER_WAIT_S) and reads one datagram, the first queued."""
        reply = self.raw(self.request(config_type), timeout)
        if reply is None:
            return None
        size, kind = struct.unpack_from("<Q32s", reply)
        assert kind.rstrip(b"\0") == b"req" and len(reply) == 40 + size
        return reply[40:].decode()

    async def apoll(self, config_type: int = 3) -> str | None:
        """poll() from a thread, for servers running on the test's own event loop."""
        import asyncio
        return await asyncio.to_thread(self.poll, config_type)

    def close(self) -> None:
        self.sock.close()
        if isinstance(self.addr, str):
            try:
                os.unlink(self.addr)
            except OSError:
                pass


@pytest.fixture
def poller_factory():
    made: list[KinetoPoller] = []

    def make(*a, **kw) -> KinetoPoller:
        p = KinetoPoller(*a, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def kineto_like_trace(path: Path, *, pid: int, start: float, duration_s: float = 0.5, cats=("cpu_op",),
                      events_per_cat: int = 20, trace_id: str | None = None, extra_top: dict | None = None,
                      profiler_span: bool = False) -> Path:
    """Write a file shaped like Kineto's CPU on-demand output (keys, order, units as torch 2.13 writes)."""
    base_ns = int(start) * 10**9
    t0 = (start - int(start)) * 1e6
    events = [{"ph": "M", "name": "thread_name", "ts": t0, "pid": pid, "tid": pid, "args": {"name": "python"}}]
    n = 0
    for cat in cats:
        for i in range(events_per_cat):
            ts = t0 + (duration_s * 1e6) * i / max(1, events_per_cat)
            events.append({"ph": "X", "cat": cat, "name": f"aten::op{n}", "pid": pid, "tid": pid, "ts": ts, "dur": 3.5,
                           "args": {"External id": n}})
            n += 1
    events.append({"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": t0 + duration_s * 1e6})
    if profiler_span:   # Kineto's own span over the collection, as torch 2.13 writes it
        events.append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
                       "ts": t0, "dur": duration_s * 1e6, "args": {"Op count": 0}})
    top = {"schemaVersion": 1, "deviceProperties": []}
    if trace_id is not None:
        top["trace_id"] = trace_id
    top.update({"host_name": "vm", "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns})
    top.update(extra_top or {})
    body = json.dumps(top)[:-1] + ', "traceEvents": [' + ",\n".join(json.dumps(e) for e in events) + "]"
    body += f', "traceName": {json.dumps(str(path))}' + "}"
    path.write_text(body)
    return path


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
