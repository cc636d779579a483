"""A tiny tmpfs mounted for one test, so "disk full" and "read-only" are the kernel's own errors.

Needs root (mount). Off CI a test without root is skipped; under CI=true (root by contract) a
failing mount is a failure, not a skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class TinyFs:
    def __init__(self, path: Path, *, size: str = "256k", inodes: int = 64):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=0777", "tmpfs",
                        str(self.path)], check=True, capture_output=True)
        self._filler = 0

    def fill(self) -> None:
        """Use every free block (the kernel then answers ENOSPC to any write)."""
        self._filler += 1
        fd = os.open(self.path / f".filler{self._filler}", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        for p in self.path.glob(".filler*"):
            p.unlink()

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True, capture_output=True)

    def files(self) -> list[str]:
        return sorted(p.name for p in self.path.rglob("*") if not p.name.startswith(".filler"))

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


def tiny_fs(path: Path, **kw) -> TinyFs:
    import pytest

    if os.geteuid() != 0 and os.environ.get("CI") != "true":
        pytest.skip("mounting a tmpfs needs root")
    return TinyFs(path, **kw)
