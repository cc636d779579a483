"""Are return probes safe on this kernel? A real self-test, run once at start before any is placed.

On x86-64 kernels from 6.11 a return probe returns through a trampoline that makes the
`uretprobe` system call (335). A process under a seccomp filter that does not allow it (container
runtimes' default profiles, systemd's filters) is killed on the first probed return, unless the
kernel lets that call through seccomp, which depends on the kernel build and its backports
(systemd #34615, libseccomp #438; reference/ebpf-gpu-signals.md). gpulens would put return probes
on every synchronising call of every GPU process on the node, so it asks the kernel instead of
guessing from a version number:

a child process installs a seccomp filter that kills on the uretprobe syscall number (allowing
everything else), the exporter places a return probe on `getpid` in the child's libc (only in that
child: the probe carries its pid), the child calls it. Killed by SIGSYS: unsafe. Alive and the
probe fired: safe. Anything else (no probe could be placed, the probe did not fire, no answer):
unsafe, with the reason, because the workload comes first.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .elfsyms import ElfError, function_offsets

__all__ = ["GateVerdict", "URETPROBE_SYSCALL", "self_test", "kernel_id"]

#: the uretprobe system call by architecture (only x86-64 has one)
URETPROBE_SYSCALL = {"x86_64": 335}.get(platform.machine())
_PROBED = "getpid"

# The child: a seccomp filter (classic BPF: load nr; nr == N ? KILL_PROCESS : ALLOW), then
# "ready", then one call of the probed function when told, then "alive".
_CHILD = r"""
import ctypes, struct, sys
nr = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
insns = [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x80000000), (0x06, 0, 0, 0x7FFF0000)]
buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in insns))
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(len(insns), ctypes.cast(buf, ctypes.c_void_p))
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
    print("noseccomp", ctypes.get_errno(), flush=True)
    sys.exit(3)
getpid = libc.getpid
print("ready", flush=True)
sys.stdin.readline()
getpid()
print("alive", flush=True)
"""


@dataclass(frozen=True)
class GateVerdict:
    safe: bool
    reason: str        # one line, shown in gpulens_exporter_source_info{source="return_probes"}
    kernel: str


def kernel_id() -> str:
    u = os.uname()
    return f"{u.release} {u.machine}"


def _libc_of(pid: int) -> str | None:
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and os.path.basename(parts[5]).startswith(("libc.so", "libc-")):
            return parts[5]
    return None


def self_test(probes, *, kill_syscall: int | None = None, timeout_s: float = 10.0) -> GateVerdict:
    """Run the self-test with `probes` (a DriverProbes). `kill_syscall` overrides the syscall the
    child's filter kills on (tests use it to make the child die where the kernel would)."""
    kernel = kernel_id()
    nr = URETPROBE_SYSCALL if kill_syscall is None else kill_syscall
    if nr is None:
        return GateVerdict(True, f"no uretprobe system call on {platform.machine()}: return probes are safe",
                           kernel)
    child = subprocess.Popen([sys.executable, "-S", "-c", _CHILD, str(nr)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    fds: list[int] = []
    try:
        first = child.stdout.readline().strip()
        if first != "ready":
            return GateVerdict(False, f"self-test inconclusive: child could not install its seccomp filter ({first!r})",
                               kernel)
        try:
            libc = _libc_of(child.pid)
            if libc is None:
                raise OSError("no libc mapped in the self-test child")
            offset = function_offsets(libc, [_PROBED])[_PROBED]
            before = probes.gate_hits()
            fds = probes.probe_return_in(child.pid, libc, offset)
        except (OSError, ElfError, KeyError) as exc:
            return GateVerdict(False, f"self-test inconclusive: no return probe could be placed ({exc})", kernel)
        try:
            child.stdin.write("go\n")
            child.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            out, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return GateVerdict(False, f"self-test inconclusive: child did not answer in {timeout_s:g} s", kernel)
        rc = child.returncode
        if rc == -signal.SIGSYS:
            return GateVerdict(False, f"a return probe killed a process under a seccomp filter that denies the "
                                      f"uretprobe syscall ({nr}) on kernel {kernel}: return probes off, "
                                      f"back-pressure unavailable", kernel)
        if rc != 0 or "alive" not in out:
            return GateVerdict(False, f"self-test inconclusive: child exited {rc}", kernel)
        if probes.gate_hits() <= before:
            return GateVerdict(False, "self-test inconclusive: the return probe did not fire", kernel)
        return GateVerdict(True, f"self-test passed on kernel {kernel}: a return probe under a seccomp filter "
                                 f"denying syscall {nr} did not kill the process", kernel)
    finally:
        for fd in fds:
            os.close(fd)
        if child.poll() is None:
            child.kill()
            child.wait(5)
        for f in (child.stdin, child.stdout):
            try:
                f.close()
            except Exception:
                pass
