"""Bring each archived trace the manifest names to a local work folder, and nothing else.

Only URIs listed in the manifest are fetched, one by one, through the archive store rooted at
the capture's folder: a URI outside that folder is refused by the store, so a crafted manifest
cannot make analysis read another capture's (or the host's) files. The archived bytes are never
modified; everything later works on these local copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from capture.archive import ArchiveError, ArchiveStore
from capture.models import Artifact
from gpulens.logs import EventLogger

from .exclusions import Exclusion

__all__ = ["Fetched", "fetch_artifacts"]


@dataclass(frozen=True)
class Fetched:
    artifact: Artifact
    path: Path | None          # None when the fetch failed
    error: str = ""


def _local_name(index: int, artifact: Artifact) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", artifact.target_id)[:80]
    return f"{index:05d}-{safe}.trace"


def fetch_artifacts(store: ArchiveStore, artifacts: list[Artifact], dest: Path, log: EventLogger) -> list[Fetched]:
    dest.mkdir(parents=True, exist_ok=True)
    out: list[Fetched] = []
    for i, artifact in enumerate(artifacts):
        path = dest / _local_name(i, artifact)
        try:
            store.download(artifact.uri, path)
        except (ArchiveError, OSError) as exc:
            log.warning("artifact.fetch_failed", target_id=artifact.target_id, rank=artifact.rank,
                        uri=artifact.uri, error=str(exc), reason=Exclusion.FETCH_FAILED.value)
            path.unlink(missing_ok=True)
            out.append(Fetched(artifact, None, str(exc)))
            continue
        log.info("artifact.fetched", target_id=artifact.target_id, rank=artifact.rank,
                 progress=f"{i + 1}/{len(artifacts)}", bytes=path.stat().st_size)
        out.append(Fetched(artifact, path))
    return out
