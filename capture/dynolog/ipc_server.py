"""The builtin trigger: the agent answers Kineto's IPC polls itself (no dynolog daemon needed).

Kineto (armed with KINETO_USE_DAEMON) sends a `req` datagram every 5 s to `dynolog`'s address;
whoever is bound there decides which config it gets. This endpoint keeps dynolog's semantics where
they matter to the agent (dynolog-kineto-protocol.md 1.6 and 3.5): one pending config per process,
a config is handed over only on a poll with the activities bit set (a tracing process polls without
it, so a request during a trace waits in the slot and shows as busy), processes not heard from for
60 s are forgotten. One deliberate difference: a request matches a process only by its own (leaf)
pid, never through its ancestors, so a worker's children that inherited the job id are not traced.
What Kineto then did with a fetched config (started, finished, refused) is read from its later
polls by `KinetoWatch` and reported through `on_kineto`.

Kineto waits about 50 ms for an answer (`poll_recv`, 5 tries 10 ms apart) and then reads the first
datagram in its socket at its *next* poll, whatever that answered. So an answer sent late is
worse than none: it stays queued, and from then on Kineto reads every answer one poll late, one
more poll for each late answer. An endpoint that stalled (a stopped or starved agent: up to
`net.unix.max_dgram_qlen`, 10, polls queue meanwhile) would leave Kineto several polls behind for
the rest of the process's life, every config fetched 5 s x N after the agent handed it over and
then called refused. The kernel stamps each datagram as it is queued (SO_TIMESTAMPNS): a poll that
waited past `answer_window_s` is not answered (the process is still kept alive, nothing is handed
over on it); its next poll, 5 s later, is.

A stall leaves one more trap, on Kineto's side. While the endpoint's queue is full, Kineto's
`sync_send` retries ten times, sleeping 10 ms doubled each time (10.23 s in all), and reports a
failure when its tenth retry goes through (`return i < num_retries` after the loop): that poll is
queued, answered on time, and never read, because Kineto did not wait. Its next poll follows at once
(its 5 s were spent in the retries) and would read that answer, its own one poll behind, for good.
So a poll queued within `IMMEDIATE_POLL_S` (2 s) of an answered one that had come after a silence of
`SILENCE_S` or more (the same process's previous poll) is left unanswered: Kineto then reads the
answer it missed, now. A process that polls fast (a test's stand-in) never shows the silence; a
poll whose ninth retry went through and was read shows the same pattern, and leaving its follower
unanswered costs that process one poll, 5 s, once per stall.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

from gpulens.ground.logs import get_logger
from . import ipcwire
from .kineto_watch import KinetoOutcome, KinetoWatch
from .results import OnDemandResult

__all__ = ["KinetoEndpoint", "Delivery", "KnownProcess", "EndpointBusy"]

_log = get_logger("agent")


class EndpointBusy(OSError):
    """Another live endpoint (a dynolog daemon, another agent) is bound at our address."""


@dataclass(frozen=True)
class Delivery:
    """Kineto fetched a config: the moment a trigger stops being a promise of dynolog's kind."""

    job_id: int
    pid: int
    trace_id: str | None
    at: float


@dataclass
class KnownProcess:
    job_id: int
    pids: tuple[int, ...]  # leaf first, then ancestors, as Kineto sent them
    last_seen: float       # monotonic
    pending: str | None = None
    pending_trace_id: str | None = None
    pending_moot_if: str | None = None        # a file whose presence makes the pending config moot
    polls: int = 0                            # polls received, answered or not
    polled_at: float | None = None            # when its last poll was queued (wall clock)
    silence_before: float = 0.0               # the gap before that poll
    answered: bool = False                    # and whether that poll was answered

    @property
    def leaf(self) -> int:
        return self.pids[0]


#: Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS; asm-generic/socket.h), which Python does not name:
#: each received datagram carries the wall-clock time the kernel queued it (struct timespec).
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
#: Kineto gives an answer about 50 ms (IpcFabricConfigClient.cpp: maxIpcRetries 5 x kSleepUs 10 ms;
#: older builds 9 x 10 ms). Answering within 40 ms of the poll being queued leaves room to send.
ANSWER_WINDOW_S = 0.040
#: Kineto polls every `ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS` (whole seconds, 5 by default); a poll
#: this soon after one that came `SILENCE_S` after its predecessor follows a sync_send that gave up
#: after its datagram went through (its ninth retry comes 5.11 s into the call, its tenth 10.23 s):
#: the answer to that one is still unread (module docstring). The follower comes within
#: milliseconds, unless the trainer is descheduled while it logs the failure; a poll whose eighth
#: retry went through (2.55 s into the call, answer read) is followed 2.45 s later, so 2 s tells them apart.
IMMEDIATE_POLL_S = 2.0
SILENCE_S = 5.0
#: after a late poll, every poll's fate is logged for this long (`ipc.poll_after_stall`)
AFTER_STALL_LOG_S = 30.0
_MAX_DATAGRAM = 1 << 16


def _queued_at(ancdata) -> float | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec + nsec / 1e9
    return None


class KinetoEndpoint:
    def __init__(self, socket_dir: str | None = None, *, name: str = ipcwire.DYNOLOG_NAME,
                 keepalive_s: float = 60.0, gc_interval_s: float = 60.0,
                 on_delivered: Callable[[Delivery], None] | None = None,
                 on_kineto: Callable[[KinetoOutcome], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, answer_window_s: float = ANSWER_WINDOW_S):
        self.socket_dir = os.path.abspath(socket_dir) if socket_dir else None
        self.address = ipcwire.endpoint_address(name, self.socket_dir)
        self.keepalive_s, self.gc_interval_s = keepalive_s, gc_interval_s
        self.on_delivered = on_delivered
        self._clock = clock
        self._procs: dict[tuple[int, frozenset[int]], KnownProcess] = {}
        self._gpu_ctx: dict[tuple[int, int], set[int]] = {}
        self.answer_window_s = answer_window_s
        self._handed: tuple | None = None     # the handover of the poll being answered (see _take_back)
        self._answering: KnownProcess | None = None   # whose poll is being answered
        # on_delivered / on_kineto calls of the datagram being answered, in order: run once it is answered
        self._after_answer: list[Callable[[], None]] = []
        self.late_unanswered = 0   # polls that waited past the window, so got no answer
        self.unread_answers = 0    # polls left unanswered so that Kineto reads an answer it missed
        self._after_stall_until = 0.0   # polls queued before this (wall clock) are logged one by one
        self._sock: socket.socket | None = None
        self._gc_task: asyncio.Task | None = None
        self._refused: set[str] = set()
        self.on_kineto = on_kineto
        self._watch = KinetoWatch(self._kineto_said, clock=clock)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if isinstance(self.address, str):
                self._claim_path(self.address)
            sock.bind(self.address)
            if isinstance(self.address, str):
                os.chmod(self.address, 0o666)  # trainers may run as other uids
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise EndpointBusy(exc.errno, f"another endpoint is bound at {self.describe()}") from exc
            raise OSError(exc.errno, f"cannot bind Kineto's IPC endpoint at {self.describe()}: {exc.strerror}") from exc
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self._gc_task = asyncio.create_task(self._gc_loop(), name="kineto-endpoint-gc")
        _log.info("ipc.listening", address=self.describe())

    def _claim_path(self, path: str) -> None:
        """Remove a stale socket file, but never one a live endpoint (say, dynolog) is bound to."""
        if not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody behind it: left over by a previous run
            return
        finally:
            probe.close()
        raise EndpointBusy(errno.EADDRINUSE, f"a live endpoint is bound at {path}")

    async def stop(self) -> None:
        if self._gc_task:
            self._gc_task.cancel()
            try:
                await self._gc_task
            except asyncio.CancelledError:
                pass
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if isinstance(self.address, str):
            try:
                os.unlink(self.address)
            except OSError:
                pass

    def may_answer(self, addr) -> bool:
        """Only answer peers in our own socket folder. Kineto checks that the answer's sender path
        starts with *its* KINETO_IPC_SOCKET_DIR and calls std::terminate otherwise (observed with
        torch 2.13), so answering a trainer that reached this socket under another path name
        would kill the training process."""
        if self.socket_dir is None:
            return True
        peer = addr.decode(errors="replace") if isinstance(addr, bytes) else str(addr or "")
        if peer.startswith(self.socket_dir + "/"):
            return True
        key = peer or "<unnamed>"
        if key not in self._refused:
            self._refused.add(key)
            _log.error("ipc.foreign_peer_ignored", peer=key, socket_dir=self.socket_dir,
                       hint="the trainer's KINETO_IPC_SOCKET_DIR must be this exact path")
        return False

    def describe(self) -> str:
        return self.address if isinstance(self.address, str) else "@" + self.address[1:-1].decode() + "\\0"

    # --- the trigger side ------------------------------------------------------------------

    def trigger(self, config: str, pids: list[int], job_id: int, *, trace_id: str | None = None,
                moot_if: str | None = None, process_limit: int = 1000) -> OnDemandResult:
        """Put `config` in the pending slot of each process of `job_id` whose own pid is in `pids`.
        `moot_if`: a path; if it exists when Kineto polls, the config is dropped, never handed over.
        A config queued again after an agent restart is a copy of one Kineto may have fetched just
        before (its answer goes before the agent's write): that trace lands at this path, and Kineto
        goes idle only after its rename, so this check at the handover keeps it from tracing twice."""
        wanted = set(pids)
        matched: list[int] = []
        triggered: list[int] = []
        busy = 0
        for key in sorted(self._procs, key=lambda k: sorted(k[1])):
            proc = self._procs[key]
            if proc.job_id != job_id or proc.leaf not in wanted:
                continue
            matched.append(proc.leaf)
            if len(triggered) >= process_limit:
                continue
            if proc.pending is None:
                proc.pending = "\n    " + config + (f"\n    REQUEST_TRACE_ID={trace_id}" if trace_id else "")
                proc.pending_trace_id, proc.pending_moot_if = trace_id, moot_if
                triggered.append(proc.leaf)
            else:
                busy += 1
        return OnDemandResult(tuple(matched), tuple(triggered), busy)

    def retract(self, trace_id: str) -> bool:
        """Take back a config Kineto has not fetched yet (its slot still holds `trace_id`): after
        this it can never start late. False when it was fetched already, or is not ours."""
        for proc in self._procs.values():
            if proc.pending is not None and proc.pending_trace_id == trace_id:
                proc.pending = proc.pending_trace_id = proc.pending_moot_if = None
                _log.info("ipc.config_retracted", job=proc.job_id, pid=proc.leaf, trace_id=trace_id)
                return True
        return False

    def settle(self, trace_id: str) -> bool:
        """The agent saw `trace_id`'s trace land (or start): Kineto no longer holds it (KinetoWatch.settle)."""
        return self._watch.settle(trace_id)

    def holds_unstarted(self, trace_id: str) -> bool:
        return self._watch.holds_unstarted(trace_id)

    def processes(self) -> list[KnownProcess]:
        return list(self._procs.values())

    def collect_garbage(self) -> int:
        """Forget processes silent for longer than keepalive_s (dynolog: 60 s); returns how many.
        Polls still queued are read first: after a stall of the agent (SIGSTOP, starvation) this may
        run before the socket's reader, and processes whose polls waited in the queue are not
        silent; forgotten, they would lose what the catch-up rule (module docstring) needs: the
        silence before their next poll (seen in the two-node test: both ranks then read every answer
        a poll late)."""
        self._readable()
        cutoff = self._clock() - self.keepalive_s
        stale = [k for k, p in self._procs.items() if p.last_seen < cutoff]
        for key in stale:
            del self._procs[key]
            self._watch.forget(key)
        return len(stale)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval_s)
            n = self.collect_garbage()
            if n:
                _log.info("ipc.forgot_processes", count=n)

    # --- the Kineto side -------------------------------------------------------------------

    def _readable(self) -> None:
        """Everything queued now, oldest first: each datagram answered only while its sender
        still waits for the answer (module docstring)."""
        while self._sock is not None:
            try:
                data, anc, _flags, addr = self._sock.recvmsg(_MAX_DATAGRAM, socket.CMSG_SPACE(_TIMESPEC.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log.debug("ipc.socket_error", error=str(exc))
                return
            if not self.may_answer(addr):
                continue
            queued = _queued_at(anc)
            waited = time.time() - queued if queued is not None else 0.0
            late = waited > self.answer_window_s
            self._handed = self._answering = None
            reply = self._handle(data, late=late, queued=queued)
            if not late and queued is not None and time.time() - queued > self.answer_window_s:
                # stopped (SIGSTOP) or descheduled between the age check and here: sent now, the answer
                # would reach Kineto after it stopped waiting and be read as the *next* poll's, every
                # later answer then a poll behind; so no answer, and a config handed over on it goes back
                waited, late = time.time() - queued, True
                self._take_back()
                if self._answering is not None:      # nothing was answered after all
                    self._answering.answered = False
            if late:
                self.late_unanswered += 1
                self._after_stall_until = time.time() + AFTER_STALL_LOG_S
                _log.info("ipc.late_poll_unanswered", peer=str(addr), waited_ms=round(waited * 1000),
                          why="Kineto stopped waiting; a late answer would leave every later one a poll behind")
            elif reply is not None and addr:
                try:
                    self._sock.sendto(reply, addr)
                except OSError as exc:  # the client vanished between its send and our answer
                    _log.debug("ipc.reply_failed", peer=str(addr), error=str(exc))
            if not late and queued is not None and queued < self._after_stall_until:
                # each poll's fate for a while after a stall: what a late reading by Kineto is traced by
                _log.info("ipc.poll_after_stall", peer=str(addr), queued=round(queued, 3), waited_ms=round(waited * 1000, 1),
                          answered=reply is not None, config=bool(reply) and len(reply) > ipcwire.HEADER.size)
            self._report()     # only now: Kineto's answer must not wait for the agent's bookkeeping

    def handle(self, datagram: bytes, *, late: bool = False) -> bytes | None:
        """Answer one datagram (None: no answer, as dynolog does for malformed input). `late`: its
        sender gave up waiting: it still counts as a sign of life, but nothing is handed over."""
        reply = self._handle(datagram, late=late)
        self._report()
        return reply

    def _report(self) -> None:
        """Tell the agent which configs were handed over (`on_delivered`) and what Kineto's polls
        said (`on_kineto`); both write the target's status to disk. Called after the answer is sent:
        Kineto waits ~50 ms for it, and an answer held up by a slow write reaches Kineto's *next*
        poll, 5 s later, where it would make every later answer a poll late and the handed-over
        config start too late to warm up (seen as a warm-up refusal on a busy node)."""
        calls, self._after_answer = self._after_answer, []
        for call in calls:
            call()

    def _handle(self, datagram: bytes, *, late: bool = False, queued: float | None = None) -> bytes | None:
        try:
            msg_type, payload = ipcwire.unpack(datagram)
            if msg_type.startswith("req"):
                req = ipcwire.parse_request(payload)
                return self._on_request(req, queued) if not late else self._on_late_request(req, queued)
            if msg_type.startswith("ctxt"):
                ctx = ipcwire.parse_context(payload)
                pids = self._gpu_ctx.setdefault((ctx.job_id, ctx.gpu), set())
                pids.add(ctx.pid)
                return ipcwire.pack("ctxt", struct.pack("<i", len(pids)))
            _log.warning("ipc.unknown_type", type=msg_type)
        except ipcwire.WireError as exc:
            _log.warning("ipc.bad_datagram", error=str(exc))
        return None

    def _on_late_request(self, req: ipcwire.Request, queued: float | None = None) -> None:
        """A poll nobody waits for: keeps a known process alive, hands nothing over, and tells the
        watch nothing (its busy bit is as old as the poll)."""
        proc = self._procs.get((req.job_id, frozenset(req.pids)))
        if proc is not None:
            proc.last_seen = self._clock()
            proc.polls += 1
            if queued is not None:
                proc.polled_at, proc.answered = queued, False
        return None

    def _on_request(self, req: ipcwire.Request, queued: float | None = None) -> bytes | None:
        key = (req.job_id, frozenset(req.pids))
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = KnownProcess(req.job_id, tuple(req.pids), self._clock())
            _log.info("ipc.registered", job=req.job_id, pids=",".join(map(str, req.pids)))
        proc.last_seen = self._clock()
        proc.polls += 1
        self._watch.on_poll(key, req.job_id, proc.leaf, req.wants_activities)
        if queued is not None:
            unread = (proc.answered and proc.silence_before >= SILENCE_S
                      and queued - proc.polled_at < IMMEDIATE_POLL_S)
            gap = queued - proc.polled_at if proc.polled_at is not None else 0.0
            proc.polled_at, proc.silence_before, proc.answered = queued, gap, not unread
            self._answering = proc
            if unread:
                # the last answer is still queued at Kineto, unread (module docstring): no answer to
                # this poll, so Kineto reads that one now instead of every later one a poll behind
                self._answering = None
                self.unread_answers += 1
                _log.info("ipc.unread_answer_left_to_read", job=req.job_id, pid=proc.leaf, gap_ms=round(gap * 1000, 1),
                          why="Kineto's sync_send gave up on a poll that went through; it reads that answer now")
                return None
        config = b""
        if req.wants_activities and proc.pending is not None and proc.pending_moot_if \
                and os.path.exists(proc.pending_moot_if):
            _log.info("ipc.config_moot", job=req.job_id, pid=proc.leaf, trace_id=proc.pending_trace_id,
                      path=proc.pending_moot_if, why="its earlier copy's trace is there: Kineto traced it already")
            proc.pending = proc.pending_trace_id = proc.pending_moot_if = None
        if req.wants_activities and proc.pending is not None:
            config = (proc.pending + "\n").encode()
            delivery = Delivery(req.job_id, proc.leaf, proc.pending_trace_id, time.time())
            # what the poll itself said is kept; what the handover adds can be taken back (_take_back)
            self._handed = (key, proc, proc.pending, proc.pending_trace_id, proc.pending_moot_if,
                            len(self._after_answer))
            self._watch.on_fetch(key, req.job_id, proc.leaf, proc.pending_trace_id, proc.pending)
            proc.pending = proc.pending_trace_id = proc.pending_moot_if = None
            _log.info("ipc.config_fetched", job=req.job_id, pid=proc.leaf, trace_id=delivery.trace_id)
            if self.on_delivered is not None:
                self._after_answer.append(lambda on=self.on_delivered, d=delivery: on(d))
        return ipcwire.pack("req", config)

    def _take_back(self) -> None:
        """Undo the handover of the poll just handled (its answer is not sent): the config is pending
        again in its slot, and neither the agent nor the watch is told it was fetched."""
        handed, self._handed = self._handed, None
        if handed is None:
            return
        key, proc, pending, trace_id, moot_if, mark = handed
        if proc.pending is None:
            proc.pending, proc.pending_trace_id, proc.pending_moot_if = pending, trace_id, moot_if
        del self._after_answer[mark:]
        self._watch.unfetch(key, trace_id)
        _log.info("ipc.config_taken_back", job=proc.job_id, pid=proc.leaf, trace_id=trace_id,
                  why="the answer would have reached Kineto after it stopped waiting")

    def _kineto_said(self, outcome: KinetoOutcome) -> None:
        _log.info("ipc.kineto_" + outcome.kind, job=outcome.job_id, pid=outcome.pid, trace_id=outcome.trace_id,
                  cause=outcome.cause, held_trace_id=outcome.held_trace_id)
        if self.on_kineto is not None:
            self._after_answer.append(lambda on=self.on_kineto, o=outcome: on(o))
