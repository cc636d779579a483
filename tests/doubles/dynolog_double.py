"""A test double for stock dynolog 0.6.0 (facebookincubator/dynolog c3a231a), both of its sides.

It stands for the `dynolog --enable_ipc_monitor` daemon and follows the wire protocol byte for
byte, as written down in shared/reference/dynolog-kineto-protocol.md (sections 1, 2.4, 3) and
checked against dynolog-observed.md. It is written independently of capture/dynolog (nothing is
imported from there), so the agent's client and endpoint are tested against a second reading of
the reference, not against themselves.

RPC side (TCP, what `dyno` and the agent call):
- one request per connection: a 4-byte native (little-endian) int32 length read with ONE read(),
  then the JSON body; a length <= 0, a short body, a body that is not a JSON object with "fn", or
  an unknown "fn" get no answer at all (the connection just closes);
- one connection at a time (dynolog's RPC thread is single-threaded and blocks on read);
- answers: 4-byte length + compact JSON with keys sorted (nlohmann's dump());
- `setKinetOnDemandRequest`: `config` and `pids` keys required (else {"status":"failed"}); wrong
  types give {"status":"failed with exception = ..."}; `job_id` is compared as the decimal string
  of a C int with each process's registered job id; `pids` [] or [0] mean every process of the
  job; a process matches when ANY pid of its registered set (itself + ancestors) is requested;
  processes are visited in order of their sorted pid sets; `process_limit` (default 1000) caps the
  triggered count; a process whose previous config was not fetched yet counts as busy.
- `getStatus` -> {"status":1} (no DCGM), `getVersion` -> {"version":"0.6.0"},
  `dcgmProfPause` (needs `duration_s`) / `dcgmProfResume` -> {"status":false}.

IPC side (AF_UNIX datagrams, what Kineto polls):
- bound at the abstract `\\0dynolog\\0` (11 bytes, trailing NUL included) or at
  `<socket_dir>/dynolog` (unlinked first, chmod 0666) when a socket dir is given (dynolog reads
  KINETO_IPC_SOCKET_DIR);
- 40-byte header (`<Q32s`: payload size, NUL-padded type) + payload; `req` payload `<iiq` (config
  type bitmask, n, job id) + n int32 pids; n == 0 gets no answer; every valid `req` is answered
  with a `req` carrying the pending config + "\\n" if the activities bit (2) is set and a config is
  pending (which clears it), else an empty payload; `ctxt` (`<iiq` gpu, pid, job) is answered with
  an int32 count of pids seen for that (job, gpu); any other type gets no answer;
- a triggered config is stored as "\\n    <config>\\n    REQUEST_TRACE_ID=<id>" (section 2.4; the id
  is a 64-bit hash of "<hostname>:<leaf pid>:<unix seconds>", like std::hash, not the same value);
- every `gc_interval_s` (60 s) processes not heard from for more than `keepalive_s` (60 s) are
  dropped, so a dead trainer stays matchable for up to ~2 minutes.

Test-only additions (not part of dynolog): `deliveries` (which configs Kineto fetched) and
`registry()`, for assertions; as a process it prints one JSON line when ready and one per delivery.

    python -m tests.doubles.dynolog_double --port 0 [--host 127.0.0.1] [--socket-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

VERSION = "0.6.0"
_HDR = struct.Struct("<Q32s")
_REQ = struct.Struct("<iiq")


@dataclass
class _Process:
    job: str
    pids: tuple[int, ...]
    last_seen: float
    pending: str = ""  # empty: nothing pending (dynolog keeps a std::string)


@dataclass
class DoubleDelivery:
    job: str
    pid: int
    config: str
    at: float = field(default_factory=time.time)


class _Ipc(asyncio.DatagramProtocol):
    def __init__(self, double: "DynologDouble"):
        self.double = double

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        reply = self.double._ipc_message(data)
        if reply is not None and addr:
            try:
                self.transport.sendto(reply, addr)
            except OSError:
                pass


class DynologDouble:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, socket_dir: str | None = None,
                 keepalive_s: float = 60.0, gc_interval_s: float = 60.0, hostname: str = "double",
                 on_delivery=None):
        self.host, self.port, self.socket_dir = host, port, socket_dir
        self.keepalive_s, self.gc_interval_s, self.hostname = keepalive_s, gc_interval_s, hostname
        self.on_delivery = on_delivery
        self.deliveries: list[DoubleDelivery] = []
        self.rpc_requests: list[dict] = []
        self._registry: dict[tuple[str, tuple[int, ...]], _Process] = {}
        self._gpu: dict[tuple[str, int], set[int]] = {}
        self._rpc_lock = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._ipc = None
        self._gc: asyncio.Task | None = None
        self.ipc_address: str | bytes = (os.path.join(socket_dir, "dynolog") if socket_dir else b"\0dynolog\0")

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, *, rpc: bool = True, ipc: bool = True) -> "DynologDouble":
        if rpc:
            self._server = await asyncio.start_server(self._rpc_connection, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
        if ipc:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            if isinstance(self.ipc_address, str):
                try:
                    os.unlink(self.ipc_address)
                except FileNotFoundError:
                    pass
            sock.bind(self.ipc_address)
            if isinstance(self.ipc_address, str):
                os.chmod(self.ipc_address, 0o666)
            sock.setblocking(False)
            self._ipc, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: _Ipc(self), sock=sock)
        self._gc = asyncio.create_task(self._gc_loop())
        return self

    async def stop(self) -> None:
        if self._gc:
            self._gc.cancel()
        if self._server:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self._ipc:
            self._ipc.close()
            self._ipc = None
            if isinstance(self.ipc_address, str):
                try:
                    os.unlink(self.ipc_address)
                except FileNotFoundError:
                    pass

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    async def _gc_loop(self):
        while True:
            await asyncio.sleep(self.gc_interval_s)
            self.collect_garbage()

    def collect_garbage(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self._registry.items() if now - p.last_seen > self.keepalive_s]:
            del self._registry[key]

    def registry(self) -> list[dict]:
        return [{"job": p.job, "pids": list(p.pids), "pending": p.pending} for p in self._registry.values()]

    # --- RPC ----------------------------------------------------------------------------------

    async def _rpc_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        async with self._rpc_lock:  # single-threaded server: one connection at a time
            try:
                answer = await self._rpc_one(reader)
                if answer is not None:
                    body = json.dumps(answer, separators=(",", ":"), sort_keys=True).encode()
                    writer.write(struct.pack("<i", len(body)) + body)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

    async def _rpc_one(self, reader: asyncio.StreamReader):
        head = await reader.read(4)  # one read(), as dynolog does
        if len(head) != 4:
            return None
        (size,) = struct.unpack("<i", head)
        if size <= 0:
            return None
        try:
            body = await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return None
        try:
            request = json.loads(body)
        except ValueError:
            return None
        if not isinstance(request, dict) or "fn" not in request:
            return None
        self.rpc_requests.append(request)
        fn = request["fn"]
        if fn == "getStatus":
            return {"status": 1}
        if fn == "getVersion":
            return {"version": VERSION}
        if fn == "dcgmProfPause":
            return {"status": False} if "duration_s" in request else {"status": "failed"}
        if fn == "dcgmProfResume":
            return {"status": False}
        if fn == "setKinetOnDemandRequest":
            return self._set_on_demand(request)
        return None  # "Unknown RPC call": no answer

    def _set_on_demand(self, req: dict) -> dict:
        if "config" not in req or "pids" not in req:
            return {"status": "failed"}
        try:
            config = _json_string(req["config"])
            pids = [_json_int(p) for p in _json_array(req["pids"])]
            job = str(_json_int(req.get("job_id", 0)))
            limit = _json_int(req.get("process_limit", 1000))
        except TypeError as exc:
            return {"status": f"failed with exception = {exc}"}
        everyone = pids == [] or pids == [0]
        wanted = set(pids)
        matched, triggered, busy = [], [], 0
        for key in sorted(k for k in self._registry if k[0] == job):
            proc = self._registry[key]
            if not (everyone or wanted & set(proc.pids)):
                continue
            leaf = proc.pids[0]
            matched.append(leaf)
            if len(triggered) < limit:
                if not proc.pending:
                    trace_id = self._trace_id(leaf)
                    proc.pending = f"\n    {config}\n    REQUEST_TRACE_ID={trace_id}"
                    triggered.append(leaf)
                else:
                    busy += 1
        return {"activityProfilersBusy": busy, "activityProfilersTriggered": triggered,
                "eventProfilersBusy": 0, "eventProfilersTriggered": [], "processesMatched": matched}

    def _trace_id(self, leaf: int) -> str:
        digest = hashlib.blake2b(f"{self.hostname}:{leaf}:{int(time.time())}".encode(), digest_size=8).digest()
        return str(int.from_bytes(digest, "little"))

    # --- IPC ----------------------------------------------------------------------------------

    def _ipc_message(self, data: bytes) -> bytes | None:
        if len(data) < _HDR.size:
            return None
        size, raw_type = _HDR.unpack_from(data)
        payload = data[_HDR.size:_HDR.size + size]
        if len(payload) != size:
            return None
        if raw_type[:4] == b"ctxt":
            if len(payload) < 16:
                return None
            gpu, pid, job = _REQ.unpack_from(payload)
            seen = self._gpu.setdefault((str(job), gpu), set())
            seen.add(pid)
            return _HDR.pack(4, b"ctxt") + struct.pack("<i", len(seen))
        if raw_type[:3] != b"req" or len(payload) < 16:
            return None  # "TYPE UNKOWN"
        config_type, n, job_id = _REQ.unpack_from(payload)
        if n <= 0 or len(payload) < 16 + 4 * n:
            return None
        pids = struct.unpack_from(f"<{n}i", payload, 16)
        job = str(job_id)
        key = (job, tuple(sorted(pids)))
        proc = self._registry.get(key)
        if proc is None:
            proc = self._registry[key] = _Process(job, tuple(pids), time.monotonic())
        proc.last_seen = time.monotonic()
        out = b""
        if config_type & 2 and proc.pending:
            out = (proc.pending + "\n").encode()
            delivery = DoubleDelivery(job, pids[0], proc.pending)
            proc.pending = ""
            self.deliveries.append(delivery)
            if self.on_delivery:
                self.on_delivery(delivery)
        return _HDR.pack(len(out), b"req") + out


def _json_int(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"[json.exception.type_error.302] type must be number, but is {_kind(v)}")
    return v


def _json_string(v):
    if not isinstance(v, str):
        raise TypeError(f"[json.exception.type_error.302] type must be string, but is {_kind(v)}")
    return v


def _json_array(v):
    if not isinstance(v, list):
        raise TypeError(f"[json.exception.type_error.302] type must be array, but is {_kind(v)}")
    return v


def _kind(v) -> str:
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), "number")


async def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.doubles.dynolog_double", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="loopback only in tests")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--socket-dir", help="bind <dir>/dynolog instead of the abstract @dynolog")
    p.add_argument("--keepalive-s", type=float, default=60.0)
    p.add_argument("--gc-interval-s", type=float, default=60.0)
    p.add_argument("--no-rpc", action="store_true")
    a = p.parse_args(argv)

    def report(d: DoubleDelivery) -> None:
        log_file = next((line.strip().partition("=")[2] for line in d.config.splitlines()
                         if line.strip().startswith("ACTIVITIES_LOG_FILE=")), None)
        print(json.dumps({"delivered": {"job": d.job, "pid": d.pid, "at": d.at, "log_file": log_file}}), flush=True)

    double = DynologDouble(host=a.host, port=a.port, socket_dir=a.socket_dir, keepalive_s=a.keepalive_s,
                           gc_interval_s=a.gc_interval_s, on_delivery=report)
    await double.start(rpc=not a.no_rpc)
    ipc = double.ipc_address if isinstance(double.ipc_address, str) else "@dynolog\\0"
    print(json.dumps({"ready": True, "rpc_port": double.port, "ipc": ipc, "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await double.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
