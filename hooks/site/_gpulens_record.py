"""The registration record: what it says, what it is called, and how it reaches disk (stdlib only).

A record is written whole or not at all: temp file, fsync, rename. On any failure (full disk,
read-only or missing folder) the temp file is removed and a `RegistryWriteError` says which file
could not be written and why, so the hook's one stderr line is accurate.
"""

from __future__ import annotations

import json
import os
import socket

SCHEMA_VERSION = 1
IDENTITY_PROCESS_GROUP = "process_group"    # registered when init_process_group returned; rank from the group
IDENTITY_SINGLE_PROCESS = "single_process"  # the fallback: imported torch, no process group (yet)


class RegistryWriteError(OSError):
    """The record could not be written; nothing was left behind in the registry folder."""


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


def build_record(env: dict, pid: int, cmdline: list[str], now: float, *,
                 identity: str = IDENTITY_PROCESS_GROUP) -> dict:
    """The record for this process; ranks come from `env` (the caller puts the process group's there)."""
    hostname = socket.gethostname()
    job_id = env.get("GPULENS_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local"
    world = _int(env, "WORLD_SIZE", 1)
    rec = {
        "schema_version": SCHEMA_VERSION,
        "job_id": job_id,
        "attempt": _int(env, "GPULENS_ATTEMPT", 0),
        "namespace": env.get("GPULENS_NAMESPACE") or env.get("POD_NAMESPACE") or "local",
        "pod": env.get("GPULENS_POD_NAME") or env.get("POD_NAME") or hostname,
        "pod_uid": env.get("GPULENS_POD_UID") or env.get("POD_UID") or "",
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
        "pid_namespace": pid_namespace(),
        "kineto_job_id": int(env["SLURM_JOB_ID"]) if env.get("SLURM_JOB_ID", "").isdigit() else 0,
        "start_time": now,
        "trace_dir": env.get("KINETO_ONDEMAND_TRACE_DIR", "/tmp"),
        "socket_dir": env.get("KINETO_IPC_SOCKET_DIR", ""),
        "hostname": hostname,
        "identity": identity,
        "argv": cmdline[:16],
    }
    if env.get("GPULENS_WORKLOAD"):
        # no Kubernetes to say which workload the pod belongs to (`gpulens up`'s serving demo): the
        # launcher names it, e.g. Deployment/web, as the exporter's gpulens_workload label
        rec["workload"] = env["GPULENS_WORKLOAD"]
    return rec


def record_filename(rec: dict) -> str:
    ns = "".join(c for c in rec["pid_namespace"] if c.isdigit()) or "0"
    return f"{rec['job_id']}__a{rec['attempt']}__r{rec['global_rank']}__ns{ns}__p{rec['pid']}.json"


def write_atomically(directory: str, name: str, data: dict) -> str:
    """Write `data` as `directory/name` whole, or raise RegistryWriteError leaving no temp file."""
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    payload = json.dumps(data, sort_keys=True).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise RegistryWriteError(exc.errno, f"cannot create a file in {directory}: {exc.strerror}") from exc
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise RegistryWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
    return path


def remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
