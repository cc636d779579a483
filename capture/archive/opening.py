"""Open the store for an archive prefix. Apart from base.py so that the stores, which import the
interface, are not imported back by it (no import circle)."""

from __future__ import annotations

from .base import ArchiveError, ArchiveStore
from .paths import archive_path

__all__ = ["open_archive"]


def open_archive(prefix: str, **options) -> ArchiveStore:
    """The store rooted at `prefix`; ArchiveError for an unsafe or unsupported prefix."""
    scheme = archive_path(prefix).scheme
    if scheme == "file":
        from .filestore import FileStore
        return FileStore(prefix)
    if scheme == "s3":
        from .s3store import S3Store
        return S3Store(prefix, **options)
    raise ArchiveError(f"unsupported archive URI {prefix!r}: use file:///path or s3://bucket/prefix")
