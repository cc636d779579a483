"""The coordinators Prometheus scrapes under `gpulens up`, as a file_sd file.

Coordinator ports are handed out as jobs register, so they cannot be in the static config. The
local operator rewrites this file whenever a coordinator starts or stops; Prometheus notices the
change itself (file_sd). Written atomically (a temporary file renamed into place): Prometheus must
never read half a list, or it would drop every coordinator until the next write.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["CoordinatorTarget", "file_sd_groups", "write_file_sd"]


@dataclass(frozen=True)
class CoordinatorTarget:
    """One running coordinator: the job's namespace and the process name stand in for the pod."""

    namespace: str
    pod: str
    url: str   # http://127.0.0.1:<port>, as the local operator starts it

    @property
    def address(self) -> str:
        return urlsplit(self.url).netloc


def file_sd_groups(targets: list[CoordinatorTarget]) -> list[dict]:
    """One group per coordinator, labelled like a PodMonitor target (`namespace`, `pod`), which is
    what GPULensCapturesFailing sums by."""
    return [{"targets": [t.address], "labels": {"namespace": t.namespace, "pod": t.pod}}
            for t in sorted(targets, key=lambda t: t.address)]


def write_file_sd(path: Path, targets: list[CoordinatorTarget]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(file_sd_groups(targets), indent=2))
    os.replace(tmp, path)
    return path
