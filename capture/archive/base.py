"""The archive interface and URI rules shared by both backends."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse


class ArchiveError(Exception):
    """An archive operation failed; `.retryable` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class ArchiveStore(Protocol):
    prefix: str

    def put_file(self, local: Path, key: str) -> str:
        """Upload a local file to <prefix>/<key>; returns its URI once the store confirmed it."""

    def put_bytes(self, data: bytes, key: str, content_type: str = "application/json") -> str: ...

    def get_bytes(self, uri: str) -> bytes: ...

    def download(self, uri: str, dest: Path) -> Path: ...

    def exists(self, uri: str) -> bool: ...


def join_uri(prefix: str, key: str) -> str:
    key = key.lstrip("/")
    if not key or ".." in key.split("/"):
        raise ArchiveError(f"bad archive key {key!r}")
    return prefix.rstrip("/") + "/" + key


def under_prefix(prefix: str, uri: str) -> bool:
    """True when `uri` names an object under `prefix` (after normalising the path)."""
    p, u = urlparse(prefix), urlparse(uri)
    if (p.scheme, p.netloc) != (u.scheme, u.netloc):
        return False
    base = posixpath.normpath("/" + p.path.strip("/"))
    path = posixpath.normpath("/" + u.path.lstrip("/"))
    return path == base or path.startswith(base.rstrip("/") + "/")


def open_archive(prefix: str, **options) -> ArchiveStore:
    scheme = urlparse(prefix).scheme
    if scheme == "file":
        from .filestore import FileStore
        return FileStore(prefix)
    if scheme == "s3":
        from .s3store import S3Store
        return S3Store(prefix, **options)
    raise ArchiveError(f"unsupported archive URI {prefix!r}: use file:///path or s3://bucket/prefix")
