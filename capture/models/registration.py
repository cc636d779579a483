"""The worker registration record: written by the trainer hook, read by agent and discovery."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import schemas
from ..wire import limits

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RegistrationRecord:
    job_id: str
    attempt: int
    namespace: str
    pod: str
    pod_uid: str
    container: str
    node: str
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: int
    pid_namespace: str
    kineto_job_id: int
    start_time: float
    trace_dir: str
    socket_dir: str
    group_rank: int = 0
    host_pid: int | None = None
    hostname: str = ""
    identity: str = ""  # process_group | single_process (older hooks: empty)
    argv: list[str] = field(default_factory=list)
    steps_file: str = ""  # the hook's step counter beside this record (older hooks, or no torch optimizer: empty)
    flight_socket: str = ""  # the hook's Flight Recorder socket in the socket folder (issue 45; older hooks: empty)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RegistrationRecord":
        schemas.validate("registration", data)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: Path) -> "RegistrationRecord":
        """Read one record file; raises OSError, ValueError (bad JSON) or SchemaError."""
        return cls.from_dict(limits.load_file(path, limits.REGISTRATION_FILE))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def base_rank(self) -> int:
        """Global rank of local rank 0 in this worker's pod."""
        return self.global_rank - self.local_rank
