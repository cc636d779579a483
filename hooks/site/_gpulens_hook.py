"""Arming logic behind the trainer hook (standard library only; imported by sitecustomize).

What it does, in order (see docs/ARCHITECTURE.md, "The trainer hook"):
1. sets KINETO_USE_DAEMON=1 and, when configured, KINETO_IPC_SOCKET_DIR / KINETO_ONDEMAND_TRACE_DIR;
2. gives Kineto a job id distinct per pod (SLURM_JOB_ID, the only job id Kineto reads) unless the
   process already runs under Slurm, so dynolog never confuses pid 37 of one pod with pid 37 of
   another on the same node;
3. works out the worker identity from torchrun/elastic and Kubernetes downward-API variables,
   skipping launchers (torchrun itself) and multiprocessing helpers, which are not workers;
4. writes one registration record atomically into GPULENS_REGISTRY_DIR and removes it at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
import zlib

SCHEMA_VERSION = 1
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("torchrun", "run.py", "launch.py")
_HELPER_MODULES = ("multiprocessing.spawn", "multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _cmdline() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(getattr(sys, "argv", []) or [])


def role(cmdline: list[str]) -> str:
    """'launcher', 'helper' or 'worker' for a Python process with this command line.

    Only the interpreter's own arguments decide (the module after -m, the code after -c, the
    script path): a worker script whose *path* mentions torchrun is still a worker.
    """
    args = cmdline[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[1:]  # interpreter flags such as -u, -O, -X dev (its value has no dash)
    if not args:
        return "worker"
    if args[0] == "-c":
        code = args[1] if len(args) > 1 else ""
        return "helper" if any(m in code for m in _HELPER_MODULES) else "worker"
    if "--multiprocessing-fork" in cmdline:
        return "helper"
    if args[0] == "-m":
        module = args[1] if len(args) > 1 else ""
        if module in _LAUNCHER_MODULES:
            return "launcher"
        return "helper" if module in _HELPER_MODULES else "worker"
    script = args[0].replace("\\", "/")
    if os.path.basename(script) == "torchrun" or script.endswith(tuple(f"torch/distributed/{n}" for n in _LAUNCHER_SCRIPTS[1:])):
        return "launcher"
    return "worker"


def _int(env: dict, name: str, default: int) -> int:
    value = env.get(name, "")
    return int(value) if value.strip() else default


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "pid:[unknown]"


def _host_pid() -> int | None:
    """Our pid in the outermost pid namespace visible to us (NSpid's first field)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def kineto_job_id(identity_key: str) -> int:
    """A positive int32 job id derived from the pod (dynolog parses job ids as C int)."""
    return (zlib.crc32(identity_key.encode()) & 0x7FFFFFFF) or 1


def build_record(env: dict, pid: int, cmdline: list[str], now: float) -> dict:
    hostname = socket.gethostname()
    pidns = pid_namespace()
    job_id = env.get("GPULENS_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local"
    attempt = _int(env, "GPULENS_ATTEMPT", 0)
    pod = env.get("GPULENS_POD_NAME") or env.get("POD_NAME") or hostname
    pod_uid = env.get("GPULENS_POD_UID") or env.get("POD_UID") or ""
    world = _int(env, "WORLD_SIZE", 1)
    return {
        "schema_version": SCHEMA_VERSION,
        "job_id": job_id,
        "attempt": attempt,
        "namespace": env.get("GPULENS_NAMESPACE") or env.get("POD_NAMESPACE") or "local",
        "pod": pod,
        "pod_uid": pod_uid,
        "container": env.get("GPULENS_CONTAINER_NAME", ""),
        "node": env.get("GPULENS_NODE_NAME") or env.get("NODE_NAME") or hostname,
        "global_rank": _int(env, "RANK", 0),
        "local_rank": _int(env, "LOCAL_RANK", 0),
        "group_rank": _int(env, "GROUP_RANK", 0),
        "world_size": world,
        "local_world_size": _int(env, "LOCAL_WORLD_SIZE", world),
        "restart_count": _int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        "pid": pid,
        "host_pid": _host_pid(),
        "pid_namespace": pidns,
        "kineto_job_id": int(env["SLURM_JOB_ID"]) if env.get("SLURM_JOB_ID", "").isdigit() else 0,
        "start_time": now,
        "trace_dir": env.get("KINETO_ONDEMAND_TRACE_DIR", "/tmp"),
        "socket_dir": env.get("KINETO_IPC_SOCKET_DIR", ""),
        "hostname": hostname,
        "argv": cmdline[:16],
    }


def record_filename(rec: dict) -> str:
    ns = "".join(c for c in rec["pid_namespace"] if c.isdigit()) or "0"
    return f"{rec['job_id']}__a{rec['attempt']}__r{rec['global_rank']}__ns{ns}__p{rec['pid']}.json"


def write_atomically(directory: str, name: str, data: dict) -> str:
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits atexit handlers; only the writer removes
        try:
            os.unlink(path)
        except OSError:
            pass


def arm(env=None, *, cmdline: list[str] | None = None) -> str | None:
    """Arm this process; returns the registration file written, or None. Raises on failure."""
    env = os.environ if env is None else env
    if env.get("GPULENS_HOOK_DISABLE", "") not in ("", "0"):
        return None
    cmdline = _cmdline() if cmdline is None else cmdline
    kind = role(cmdline)
    env["KINETO_USE_DAEMON"] = "1"
    if env.get("GPULENS_SOCKET_DIR"):
        env["KINETO_IPC_SOCKET_DIR"] = env["GPULENS_SOCKET_DIR"]
    if env.get("GPULENS_TRACE_DIR"):
        env["KINETO_ONDEMAND_TRACE_DIR"] = env["GPULENS_TRACE_DIR"]
    if kind != "worker":
        # Launchers and multiprocessing helpers import torch too, but are not workers: they get no
        # record and keep Kineto's job 0, so a request for a worker's job id never reaches them.
        return None
    pidns = pid_namespace()
    if not env.get("SLURM_JOB_ID") and env.get("GPULENS_KINETO_JOB_ID", "auto") == "auto":
        key = "|".join([env.get("GPULENS_POD_UID") or env.get("POD_UID") or socket.gethostname(), pidns,
                        env.get("GPULENS_JOB_ID", ""), env.get("GPULENS_ATTEMPT", "0")])
        env["SLURM_JOB_ID"] = str(kineto_job_id(key))
    registry = env.get("GPULENS_REGISTRY_DIR")
    if not registry:
        return None
    pid = os.getpid()
    rec = build_record(dict(env), pid, cmdline, time.time())
    path = write_atomically(registry, record_filename(rec), rec)
    atexit.register(_remove, path, pid)
    return path


def main() -> None:
    arm()


def chain_sitecustomize(our_file: str) -> None:
    """Run the next `sitecustomize` on sys.path (the trainer image's own), if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(our_file))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == os.path.abspath(our_file):
        return
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        sys.modules["_gpulens_chained_sitecustomize"] = module
    except Exception as exc:
        print(f"gpulens-hook: chained sitecustomize {spec.origin} failed: {exc}", file=sys.stderr)
