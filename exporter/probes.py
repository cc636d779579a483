"""The eBPF side: compile the counters program, attach it to driver library files, read its maps.

bcc is imported only here and only when probes are built, so the exporter runs (and says why
the eBPF source is off) on a machine without bcc, kernel headers or privileges. Attachments are
managed here rather than through bcc's `attach_uprobe`, so one library file can be detached when
its last user unmaps it, and so detaching does not need tracefs (perf-PMU uprobes only need their
file descriptor closed).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .btf import BtfError, member_offsets
from .elfsyms import ElfError, function_offsets
from .symbols import DRIVER_PROBES, ProbeSpec

__all__ = ["ProbeUnavailable", "ProcessKey", "ProcessCounters", "MapUsage", "AttachResult",
           "DriverProbes", "PROGRAM_PATH"]

PROGRAM_PATH = Path(__file__).parent / "bpf" / "counters.c"
_BPF_PROBE_ENTRY, _BPF_PROBE_RETURN = 0, 1
_LEGACY_UPROBE_EVENTS = ("/sys/kernel/tracing/uprobe_events", "/sys/kernel/debug/tracing/uprobe_events")


class ProbeUnavailable(RuntimeError):
    """eBPF cannot run here (no bcc, no privileges, no kernel headers); the message says which."""


@dataclass(frozen=True, order=True)
class ProcessKey:
    """A process, robust to pid reuse: host tgid plus its start time (ns since boot)."""
    tgid: int
    start_ns: int


@dataclass(frozen=True)
class ProcessCounters:
    key: ProcessKey
    comm: str
    cgroup_id: int
    launches: int = 0
    graph_launches: int = 0
    sync_calls: int = 0
    sync_seconds: float = 0.0      # finished blocking calls plus time blocked so far in open ones
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_calls: int = 0
    d2h_calls: int = 0


@dataclass(frozen=True)
class MapUsage:
    name: str
    entries: int
    capacity: int
    update_failures: int


@dataclass
class AttachResult:
    attached: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Attachment:
    path: str
    fds: list[tuple[int, bytes]]       # (perf fd, event name)


class DriverProbes:
    """One compiled BPF program whose probes can be attached to many library files."""

    def __init__(self, *, max_processes: int = 16384, max_inflight: int = 65536, empty: bool = False):
        try:
            import bcc  # noqa: F401  (Debian python3-bpfcc)
            from bcc import BPF
            from bcc.libbcc import lib
        except ImportError as exc:  # pragma: no cover - depends on the host
            raise ProbeUnavailable(f"bcc is not installed ({exc})") from exc
        if os.geteuid() != 0:
            raise ProbeUnavailable("eBPF needs root (or CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN)")
        cflags = [f"-DMAX_PROCS={int(max_processes)}", f"-DMAX_INFLIGHT={int(max_inflight)}"]
        if empty:
            cflags.append("-DEMPTY_PROBES")
        #: why process start times are unavailable (pid reuse then merges counts), or None
        self.start_time_problem: str | None = None
        try:
            offs = member_offsets("task_struct", ["group_leader", "start_boottime"])
            cflags += [f"-DTASK_GROUP_LEADER_OFF={offs['group_leader']}",
                       f"-DTASK_START_BOOTTIME_OFF={offs['start_boottime']}"]
        except (OSError, BtfError) as exc:
            self.start_time_problem = f"no kernel BTF ({exc})"
        try:
            self._bpf = BPF(src_file=str(PROGRAM_PATH).encode(), cflags=cflags)
        except Exception as exc:
            raise ProbeUnavailable(f"BPF program did not load: {exc}") from exc
        self._BPF, self._lib = BPF, lib
        self.capacity = {"procs": int(max_processes), "inflight": int(max_inflight)}
        self._attachments: dict[tuple[int, int], _Attachment] = {}
        self._funcs: dict[str, int] = {}
        self._closed = False

    # ---- attachments -------------------------------------------------------------------------

    @property
    def probes_attached(self) -> int:
        return sum(len(a.fds) for a in self._attachments.values())

    @property
    def libraries(self) -> set[tuple[int, int]]:
        return set(self._attachments)

    def _func_fd(self, name: str) -> int:
        if name not in self._funcs:
            self._funcs[name] = self._bpf.load_func(name.encode(), self._BPF.KPROBE).fd
        return self._funcs[name]

    def attach(self, key: tuple[int, int], path: str, probes: tuple[ProbeSpec, ...] = DRIVER_PROBES) -> AttachResult:
        """Attach every probe whose symbol `path` exports; idempotent per library key (dev, inode)."""
        result = AttachResult()
        if key in self._attachments:
            return result
        try:
            offsets = function_offsets(path, [p.symbol for p in probes])
        except (OSError, ElfError) as exc:
            result.errors.append(f"{path}: {exc}")
            return result
        if not offsets:
            result.errors.append(f"{path}: exports none of the driver symbols")
            return result
        attachment = _Attachment(path=path, fds=[])
        seen_offsets: set[int] = set()
        for spec in probes:
            offset = offsets.get(spec.symbol)
            if offset is None or offset in seen_offsets:
                continue
            seen_offsets.add(offset)
            for func, kind, tag in ((spec.entry, _BPF_PROBE_ENTRY, "p"), (spec.ret, _BPF_PROBE_RETURN, "r")):
                if func is None:
                    continue
                event = f"{tag}_gpulens_{os.getpid()}_{key[0]:x}_{key[1]:x}_{offset:x}".encode()
                try:
                    fd = self._lib.bpf_attach_uprobe(self._func_fd(func), kind, event, path.encode(), offset, -1)
                except Exception as exc:  # load_func failures
                    fd, err = -1, str(exc)
                else:
                    err = os.strerror(ctypes.get_errno()) if fd < 0 else ""
                if fd < 0:
                    result.errors.append(f"{path}:{spec.symbol}: attach failed {err}".strip())
                    continue
                attachment.fds.append((fd, event))
                result.attached += 1
        if attachment.fds:
            self._attachments[key] = attachment
        return result

    def detach(self, key: tuple[int, int]) -> int:
        attachment = self._attachments.pop(key, None)
        if attachment is None:
            return 0
        legacy = any(os.path.exists(p) for p in _LEGACY_UPROBE_EVENTS)
        for fd, event in attachment.fds:
            self._lib.bpf_close_perf_event_fd(fd)
            if legacy:
                self._lib.bpf_detach_uprobe(event)   # only probes made through tracefs need this
        return len(attachment.fds)

    # ---- maps --------------------------------------------------------------------------------

    @staticmethod
    def _items(table):
        try:
            return list(table.items_lookup_batch())
        except Exception:  # kernels or maps without batch ops
            return list(table.items())

    def read(self) -> list[ProcessCounters]:
        """Counters of every process in the map; open blocking calls count up to now (monotonic)."""
        now = time.monotonic_ns()
        open_ns: dict[ProcessKey, int] = {}
        for _tid, call in self._items(self._bpf["inflight"]):
            key = ProcessKey(call.proc.tgid, call.proc.start_ns)
            open_ns[key] = open_ns.get(key, 0) + max(0, now - call.start_ns)
        out = []
        for k, v in self._items(self._bpf["procs"]):
            key = ProcessKey(k.tgid, k.start_ns)
            out.append(ProcessCounters(
                key=key, comm=bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace"),
                cgroup_id=v.cgroup_id, launches=v.launches, graph_launches=v.graph_launches,
                sync_calls=v.sync_calls, sync_seconds=(v.sync_ns + open_ns.get(key, 0)) / 1e9,
                h2d_bytes=v.h2d_bytes, d2h_bytes=v.d2h_bytes, h2d_calls=v.h2d_calls, d2h_calls=v.d2h_calls))
        return out

    def read_one(self, key: ProcessKey) -> ProcessCounters | None:
        """One process's entry (without open-call time): the final read of an exited process."""
        table = self._bpf["procs"]
        try:
            v = table[table.Key(key.tgid, 0, key.start_ns)]
        except KeyError:
            return None
        return ProcessCounters(
            key=key, comm=bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace"), cgroup_id=v.cgroup_id,
            launches=v.launches, graph_launches=v.graph_launches, sync_calls=v.sync_calls,
            sync_seconds=v.sync_ns / 1e9, h2d_bytes=v.h2d_bytes, d2h_bytes=v.d2h_bytes,
            h2d_calls=v.h2d_calls, d2h_calls=v.d2h_calls)

    def forget(self, keys: list[ProcessKey]) -> None:
        """Delete the entries of processes that have exited (after their counts were kept)."""
        table = self._bpf["procs"]
        for key in keys:
            k = table.Key(key.tgid, 0, key.start_ns)
            try:
                del table[k]
            except KeyError:
                pass

    def prune_inflight(self, alive_thread) -> int:
        """Drop open-call entries of threads that no longer exist (killed while blocked)."""
        table = self._bpf["inflight"]
        dead = []
        for k, _v in self._items(table):
            tid_tgid = int(getattr(k, "value", k))
            if not alive_thread(tid_tgid >> 32, tid_tgid & 0xFFFFFFFF):
                dead.append(tid_tgid)
        for tid_tgid in dead:
            try:
                del table[table.Key(tid_tgid)]
            except KeyError:
                pass
        return len(dead)

    def map_usage(self) -> list[MapUsage]:
        failures = self._bpf["failures"]
        fail = [failures[ctypes.c_int(i)].value for i in range(2)]
        return [
            MapUsage("procs", len(self._items(self._bpf["procs"])), self.capacity["procs"], fail[0]),
            MapUsage("inflight", len(self._items(self._bpf["inflight"])), self.capacity["inflight"], fail[1]),
        ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._attachments):
            self.detach(key)
        self._bpf.cleanup()
