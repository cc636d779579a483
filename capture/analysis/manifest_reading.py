"""Read a capture manifest and refuse it unless it names something to analyse.

The manifest is the only input analysis trusts: it says which ranks were expected, which trace
files were archived (with checksums) and which targets failed. An empty manifest, or one without a
single archived artifact, is refused here, before any trace is fetched or HTA is imported, so a
zero exit code can only ever mean that something was analysed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from gpulens.capture import schemas
from gpulens.capture.wire import limits
from gpulens.capture.archive import ArchiveError, ArchiveStore, open_archive
from gpulens.capture.models import Manifest

__all__ = ["ManifestInput", "ManifestRefused", "read_manifest", "capture_prefix_of"]

#: a manifest is a small receipt; anything bigger is not one (and must not exhaust memory)
MAX_MANIFEST_BYTES = limits.MANIFEST_FILE.max_bytes


class ManifestRefused(Exception):
    """The manifest cannot be analysed; `.code` says why in one word for logs and tests."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ManifestInput:
    uri: str
    capture_prefix: str  # the folder holding manifest.json: artifacts and outputs live under it
    manifest: Manifest
    store: ArchiveStore


def capture_prefix_of(manifest_uri: str) -> str:
    """The archive folder of a capture is the folder of its manifest."""
    u = urlparse(manifest_uri)
    if u.scheme not in ("file", "s3"):
        raise ManifestRefused("bad_uri", f"manifest URI must be file:///... or s3://bucket/...: {manifest_uri!r}")
    head, _, name = u.path.rstrip("/").rpartition("/")
    if not name or (u.scheme == "s3" and not u.netloc):
        raise ManifestRefused("bad_uri", f"manifest URI names no file: {manifest_uri!r}")
    return f"{u.scheme}://{u.netloc}{head}" if head else f"{u.scheme}://{u.netloc}"


def read_manifest(manifest_uri: str, **archive_options: Any) -> ManifestInput:
    """Fetch, parse and validate the manifest; raise ManifestRefused with a readable message."""
    prefix = capture_prefix_of(manifest_uri)
    try:
        store = open_archive(prefix, **archive_options)
        raw = store.get_bytes(manifest_uri)
    except ArchiveError as exc:
        raise ManifestRefused("unreadable", f"cannot read manifest {manifest_uri}: {exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestRefused("too_large", f"manifest {manifest_uri} is {len(raw)} bytes; refusing over {MAX_MANIFEST_BYTES}")
    try:
        data = limits.loads(raw, limits.MANIFEST_FILE)
    except limits.JsonLimitError as exc:
        raise ManifestRefused("too_large" if exc.limit == "max_bytes" else "too_deep",
                              f"manifest {manifest_uri}: {exc}") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestRefused("not_json", f"manifest {manifest_uri} is not JSON: {exc}") from exc
    if isinstance(data, dict) and not data:
        raise ManifestRefused("empty", f"manifest {manifest_uri} is empty: nothing to analyse")
    try:
        manifest = Manifest.from_dict(data)
    except schemas.SchemaError as exc:
        raise ManifestRefused("invalid", f"manifest {manifest_uri} is invalid: {exc}") from exc
    if not manifest.expected_targets and not manifest.artifacts:
        raise ManifestRefused("empty", f"manifest {manifest_uri} is empty: no expected targets and no archived "
                                       "artifacts, nothing to analyse")
    if not manifest.artifacts:
        failed = ", ".join(f"{f.target_id}={f.reason}" for f in manifest.failures[:8]) or "none recorded"
        raise ManifestRefused("no_artifacts", f"manifest {manifest_uri} has no archived artifact "
                                              f"({len(manifest.expected_targets)} expected; failures: {failed}): "
                                              "nothing to analyse")
    return ManifestInput(uri=manifest_uri, capture_prefix=prefix, manifest=manifest, store=store)
