"""`file://` archive for the embedded default: a copy is durable once fsync'd and renamed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from .base import ArchiveError
from .paths import archive_path, join_uri, resolve


class FileStore:
    def __init__(self, prefix: str):
        if archive_path(prefix).scheme != "file":
            raise ArchiveError(f"not a file:// prefix: {prefix!r}")
        self.prefix = prefix.rstrip("/")

    def _path(self, uri: str) -> Path:
        return Path(resolve(self.prefix, uri).path)  # the decoded path that was checked

    def _write(self, uri: str, writer) -> str:
        dest = self._path(uri)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
            with open(tmp, "wb") as f:
                writer(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except OSError as exc:
            raise ArchiveError(f"writing {uri}: {exc}", retryable=True) from exc
        return uri

    def put_file(self, local: Path, key: str) -> str:
        def copy(f):
            with open(local, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        return self._write(join_uri(self.prefix, key), copy)

    def put_bytes(self, data: bytes, key: str, content_type: str = "application/json") -> str:
        return self._write(join_uri(self.prefix, key), lambda f: f.write(data))

    def get_bytes(self, uri: str) -> bytes:
        try:
            return self._path(uri).read_bytes()
        except OSError as exc:
            raise ArchiveError(f"reading {uri}: {exc}") from exc

    def download(self, uri: str, dest: Path) -> Path:
        try:
            shutil.copyfile(self._path(uri), dest)
        except OSError as exc:
            raise ArchiveError(f"reading {uri}: {exc}") from exc
        return dest

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()
