"""The eBPF side: compile the counters program, attach it to driver library files, read its maps.

bcc is imported only here and only when probes are built, so the exporter runs (and says why
the eBPF source is off) on a machine without bcc, kernel headers or privileges.

Attachments are made here rather than through bcc's `attach_uprobe`. On kernels with multi-uprobe
links (6.6+) a library gets two links: every entry probe on one program (`on_entry`, the probe
kind in the attach cookie) and every return probe on another. Removing a uprobe waits for an RCU
grace period, so detaching 31 single perf-event uprobes takes seconds, two links a fraction of a
second; that matters because detaching happens when a job's last process exits. Older kernels
get one perf-event uprobe per probe (closing the fd detaches it; tracefs is not needed).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .btf import BtfError, member_offsets
from .elfsyms import ElfError, function_offsets
from .kheaders import KernelHeaders, choose as choose_headers
from .symbols import DRIVER_PROBES, ProbeSpec, entry_only

__all__ = ["ProbeUnavailable", "ProcessKey", "ProcessCounters", "MapUsage", "AttachResult",
           "DriverProbes", "PROGRAM_PATH"]

PROGRAM_PATH = Path(__file__).parent / "bpf" / "counters.c"
_BPF_PROBE_ENTRY, _BPF_PROBE_RETURN = 0, 1
_BPF_TRACE_UPROBE_MULTI = 48          # enum bpf_attach_type
_BPF_LINK_CREATE = 28                 # enum bpf_cmd
_BPF_F_UPROBE_MULTI_RETURN = 1
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
# where a function's 9th argument (cuLaunchKernel's stream) lies above the stack pointer at entry:
# x86-64 passes 6 in registers (then the return address, args 7, 8, 9), aarch64 passes 8
_STACK_ARG9_OFF = {"x86_64": 24, "aarch64": 0}


class _LinkCreateUprobeMulti(ctypes.Structure):
    """union bpf_attr, link_create flavour with the uprobe_multi member (uapi/linux/bpf.h)."""
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64), ("cnt", ctypes.c_uint32),
                ("multi_flags", ctypes.c_uint32), ("pid", ctypes.c_uint32), ("_pad", ctypes.c_uint8 * 84)]


def _link_uprobe_multi(prog_fd: int, path: str, offsets: list[int], cookies: list[int], ret: bool,
                       pid: int = 0) -> int:
    """One BPF link placing `prog_fd` at every offset of `path` (only in process `pid` if given);
    raises OSError."""
    if _SYS_BPF is None:
        raise OSError(38, "bpf() syscall number unknown on this architecture")
    libc = ctypes.CDLL(None, use_errno=True)
    cpath = ctypes.create_string_buffer(path.encode())
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    cks = (ctypes.c_uint64 * len(cookies))(*cookies)
    attr = _LinkCreateUprobeMulti(prog_fd=prog_fd, attach_type=_BPF_TRACE_UPROBE_MULTI,
                                  path=ctypes.addressof(cpath), offsets=ctypes.addressof(offs),
                                  cookies=ctypes.addressof(cks), cnt=len(offsets),
                                  multi_flags=_BPF_F_UPROBE_MULTI_RETURN if ret else 0, pid=pid)
    fd = libc.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_long(_BPF_LINK_CREATE), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd
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
    graph_kernels: int = 0         # kernels run through graph launches of known kernel count
    graph_unknown: int = 0         # graph launches whose kernel count is unknown
    captured: int = 0              # launches recorded into a graph being captured (not run then)
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
    probes: int = 0                                          # (symbol, entry|return) pairs placed
    links: list[int] = field(default_factory=list)           # multi-uprobe link fds
    fds: list[tuple[int, bytes]] = field(default_factory=list)   # per-probe perf fds, event names


class DriverProbes:
    """One compiled BPF program whose probes can be attached to many library files."""

    def __init__(self, *, max_processes: int = 16384, max_inflight: int = 65536, max_graphs: int = 65536,
                 empty: bool = False):
        try:
            import bcc  # noqa: F401  (Debian python3-bpfcc)
            from bcc import BPF
            from bcc.libbcc import lib
        except ImportError as exc:  # pragma: no cover - depends on the host
            raise ProbeUnavailable(f"bcc is not installed ({exc})") from exc
        if os.geteuid() != 0:
            raise ProbeUnavailable("eBPF needs root (or CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN)")
        cflags = [f"-DMAX_PROCS={int(max_processes)}", f"-DMAX_INFLIGHT={int(max_inflight)}",
                  f"-DMAX_GRAPHS={int(max_graphs)}"]
        arg9 = _STACK_ARG9_OFF.get(os.uname().machine)
        if arg9 is None:
            raise ProbeUnavailable(f"unsupported architecture {os.uname().machine}")
        cflags.append(f"-DSTACK_ARG9_OFF={arg9}")
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
        #: the kernel headers bcc compiles against (the host's, else the image's bundled tree)
        self.kernel_headers: KernelHeaders = choose_headers(os.uname().release, os.environ)
        os.environ.update(self.kernel_headers.env)       # bcc reads BCC_KERNEL_SOURCE from there only
        try:
            self._bpf = BPF(src_file=str(PROGRAM_PATH).encode(), cflags=cflags)
        except Exception as exc:
            raise ProbeUnavailable(f"BPF program did not load: {exc} "
                                   f"(kernel headers: {self.kernel_headers.describe()})") from exc
        self._BPF, self._lib = BPF, lib
        self.capacity = {"procs": int(max_processes), "inflight": int(max_inflight), "graphs": int(max_graphs)}
        self._attachments: dict[tuple[int, int], _Attachment] = {}
        self._funcs: dict[tuple[str, int], int] = {}
        self._closed = False
        #: whether multi-uprobe links work here (None: not tried yet)
        self.multi_links: bool | None = None
        #: False once the safety gate (retprobe_gate.py) found return probes unsafe on this kernel:
        #: blocking calls then get no probe at all and synchronous copies an entry probe only
        self.return_probes = True

    # ---- attachments -------------------------------------------------------------------------

    @property
    def probes_attached(self) -> int:
        return sum(a.probes for a in self._attachments.values())

    @property
    def libraries(self) -> set[tuple[int, int]]:
        return set(self._attachments)

    def attachment_paths(self) -> dict[tuple[int, int], str]:
        return {k: a.path for k, a in self._attachments.items()}

    def _func_fd(self, name: str, attach_type: int = -1) -> int:
        if (name, attach_type) not in self._funcs:
            fn = self._bpf.load_func(name.encode(), self._BPF.KPROBE, None, attach_type)
            self._funcs[(name, attach_type)] = fn.fd
        return self._funcs[(name, attach_type)]

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
        chosen: list[tuple[ProbeSpec, int]] = []
        seen_offsets: set[int] = set()
        if not self.return_probes:
            probes = entry_only(probes)
        for spec in probes:
            offset = offsets.get(spec.symbol)
            if offset is not None and offset not in seen_offsets:   # aliases: one probe per address
                seen_offsets.add(offset)
                chosen.append((spec, offset))
        attachment = _Attachment(path=path)
        if self.multi_links is not False and self._attach_links(attachment, chosen, result):
            self.multi_links = True
        else:
            self._attach_perf(attachment, key, chosen, result)
        if attachment.links or attachment.fds:
            self._attachments[key] = attachment
        return result

    def _attach_links(self, attachment: _Attachment, chosen, result: AttachResult) -> bool:
        entries = [(offset, spec.kind) for spec, offset in chosen]
        returns = [(offset, spec.kind) for spec, offset in chosen if spec.ret]
        try:
            # Returns before entries (and detach in the reverse order): a process already running
            # that enters a blocking call between the two attachments must not leave an entry
            # whose return is never seen. Such an entry stays open for good (the thread's later
            # calls nest inside it) and its "still blocked" time grows at 1 s/s: a worker measured
            # as blocked all the time (CI on a55018b: the demo's first pod, whose processes ran
            # while the probes attached, read a 0.578 blocked share, the mean of 1.0 and 0.156).
            if returns:
                attachment.links.append(_link_uprobe_multi(
                    self._func_fd("on_return", _BPF_TRACE_UPROBE_MULTI), attachment.path,
                    [o for o, _k in returns], [k for _o, k in returns], ret=True))
            attachment.links.append(_link_uprobe_multi(
                self._func_fd("on_entry", _BPF_TRACE_UPROBE_MULTI), attachment.path,
                [o for o, _k in entries], [k for _o, k in entries], ret=False))
        except Exception as exc:
            for fd in attachment.links:
                os.close(fd)
            attachment.links.clear()
            if self.multi_links is None:   # first try on this kernel: fall back for good
                self.multi_links = False
                return False
            result.errors.append(f"{attachment.path}: multi-uprobe link failed: {exc}")
            return True
        attachment.probes = len(entries) + len(returns)
        result.attached = attachment.probes
        return True

    def _attach_perf(self, attachment: _Attachment, key, chosen, result: AttachResult) -> None:
        # every return probe before any entry probe, for the reason _attach_links gives
        for ret in (True, False):
            for spec, offset in chosen:
                func, kind, tag = (spec.ret, _BPF_PROBE_RETURN, "r") if ret else (spec.entry, _BPF_PROBE_ENTRY, "p")
                if func is None:
                    continue
                event = f"{tag}_gpulens_{os.getpid()}_{key[0]:x}_{key[1]:x}_{offset:x}".encode()
                try:
                    fd = self._lib.bpf_attach_uprobe(self._func_fd(func), kind, event, attachment.path.encode(),
                                                     offset, -1)
                except Exception as exc:  # load_func failures
                    fd, err = -1, str(exc)
                else:
                    err = os.strerror(ctypes.get_errno()) if fd < 0 else ""
                if fd < 0:
                    result.errors.append(f"{attachment.path}:{spec.symbol}: attach failed {err}".strip())
                    continue
                attachment.fds.append((fd, event))
                attachment.probes += 1
                result.attached += 1

    def probe_return_in(self, pid: int, path: str, offset: int) -> list[int]:
        """The safety gate's probe: a return probe on `path`+`offset`, only in process `pid`.
        Returns the fds to close; raises OSError when no return probe can be placed."""
        if self.multi_links is not False:
            try:
                return [_link_uprobe_multi(self._func_fd("on_gate_return", _BPF_TRACE_UPROBE_MULTI), path,
                                           [offset], [0], ret=True, pid=pid)]
            except OSError:
                if self.multi_links:
                    raise
        event = f"r_gpulens_gate_{os.getpid()}_{pid}_{offset:x}".encode()
        fd = self._lib.bpf_attach_uprobe(self._func_fd("on_gate_return_perf"), _BPF_PROBE_RETURN, event, path.encode(),
                                         offset, pid)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"return probe on {path}+{offset:#x}: {os.strerror(err)}")
        return [fd]

    def gate_hits(self) -> int:
        return int(self._bpf[b"gate_hits"][ctypes.c_int(0)].value)

    def detach(self, key: tuple[int, int]) -> int:
        attachment = self._attachments.pop(key, None)
        if attachment is None:
            return 0
        # entries first (attached last): no call can then enter with its return unwatched
        for fd in reversed(attachment.links):
            os.close(fd)
        legacy = any(os.path.exists(p) for p in _LEGACY_UPROBE_EVENTS)
        for fd, event in reversed(attachment.fds):
            self._lib.bpf_close_perf_event_fd(fd)
            if legacy:
                self._lib.bpf_detach_uprobe(event)   # only probes made through tracefs need this
        return attachment.probes

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
        for _tid, call in self._items(self._bpf[b"inflight"]):
            key = ProcessKey(call.proc.tgid, call.proc.start_ns)
            open_ns[key] = open_ns.get(key, 0) + max(0, now - call.start_ns)
        out = []
        for k, v in self._items(self._bpf[b"procs"]):
            key = ProcessKey(k.tgid, k.start_ns)
            out.append(ProcessCounters(
                key=key, comm=bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace"),
                cgroup_id=v.cgroup_id, launches=v.launches, graph_launches=v.graph_launches,
                graph_kernels=v.graph_kernels, graph_unknown=v.graph_unknown, captured=v.captured,
                sync_calls=v.sync_calls, sync_seconds=(v.sync_ns + open_ns.get(key, 0)) / 1e9,
                h2d_bytes=v.h2d_bytes, d2h_bytes=v.d2h_bytes, h2d_calls=v.h2d_calls, d2h_calls=v.d2h_calls))
        return out

    def read_one(self, key: ProcessKey) -> ProcessCounters | None:
        """One process's entry (without open-call time): the final read of an exited process."""
        table = self._bpf[b"procs"]
        try:
            v = table[table.Key(key.tgid, 0, key.start_ns)]
        except KeyError:
            return None
        return ProcessCounters(
            key=key, comm=bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace"), cgroup_id=v.cgroup_id,
            launches=v.launches, graph_launches=v.graph_launches, graph_kernels=v.graph_kernels,
            graph_unknown=v.graph_unknown, captured=v.captured, sync_calls=v.sync_calls,
            sync_seconds=v.sync_ns / 1e9, h2d_bytes=v.h2d_bytes, d2h_bytes=v.d2h_bytes,
            h2d_calls=v.h2d_calls, d2h_calls=v.d2h_calls)

    def forget(self, keys: list[ProcessKey]) -> None:
        """Delete the entries of processes that have exited (after their counts were kept), and
        their graph bookkeeping."""
        table = self._bpf[b"procs"]
        for key in keys:
            k = table.Key(key.tgid, 0, key.start_ns)
            try:
                del table[k]
            except KeyError:
                pass
        tgids = {k.tgid for k in keys}
        if tgids:
            for name in (b"graphs", b"execs", b"captures"):
                m = self._bpf[name]
                for gk in [gk for gk, _v in self._items(m) if gk.tgid in tgids]:
                    try:
                        del m[gk]
                    except KeyError:
                        pass

    def prune_inflight(self, alive_thread) -> int:
        """Drop open-call entries of threads that no longer exist (killed while blocked)."""
        table = self._bpf[b"inflight"]
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
        failures = self._bpf[b"failures"]
        fail = [failures[ctypes.c_int(i)].value for i in range(2)]
        graph_fail = self._bpf[b"graph_failures"][ctypes.c_int(0)].value
        graphs = len(self._items(self._bpf[b"graphs"])) + len(self._items(self._bpf[b"execs"]))
        return [
            MapUsage("procs", len(self._items(self._bpf[b"procs"])), self.capacity["procs"], fail[0]),
            MapUsage("inflight", len(self._items(self._bpf[b"inflight"])), self.capacity["inflight"], fail[1]),
            MapUsage("graphs", graphs, 2 * self.capacity["graphs"], graph_fail),
        ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._attachments):
            self.detach(key)
        self._bpf.cleanup()
