"""The archive interface shared by both backends (the URI rule: paths.py; opening one: opening.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


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

