"""Who may call a gpulens HTTP API: a bearer token (or, for Alertmanager, HTTP basic) read from files.

Secrets are files, never flags, and are re-read when the file changes (Kubernetes rotates mounted
Secrets in place), so a rotation needs no restart. Comparison is constant-time. Only `/healthz`
is open; everything else answers 401 without saying which part of the credential was wrong.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable

from aiohttp import web

__all__ = ["SecretFile", "FixedSecret", "Credentials", "auth_middleware", "OPEN_PATHS"]

OPEN_PATHS = frozenset({"/healthz"})


@dataclass
class SecretFile:
    """The stripped content of one secret file, cached until its mtime or size changes."""

    path: Path
    _stamp: tuple[int, int] | None = field(default=None, repr=False)
    _value: str = field(default="", repr=False)

    def read(self) -> str:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._value  # a file briefly absent during a rotation keeps the last value
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                self._value = Path(self.path).read_text().strip()
            except OSError:
                return self._value
            self._stamp = stamp
        return self._value

    @classmethod
    def optional(cls, path: str | Path, on_missing: Callable[[Path], None]) -> "SecretFile":
        """A secret a side effect needs (Grafana's token): missing at start-up it is reported
        through `on_missing` and read again on every use, so adding it later (a Secret's new key
        reaches a mounted volume) needs no restart, and its absence never stops captures."""
        sf = cls(Path(path))
        if not sf.read():
            on_missing(sf.path)
        return sf

    @classmethod
    def required(cls, path: str | Path) -> "SecretFile":
        """A secret that must exist and be non-empty at start-up (fail fast on a wrong mount)."""
        sf = cls(Path(path))
        if not sf.read():
            raise ValueError(f"secret file {path} is missing or empty")
        return sf


def _basic_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for line in text.splitlines():
        user, sep, password = line.strip().partition(":")
        if sep and user and password:
            pairs.append((user, password))
    return pairs


@dataclass(frozen=True)
class FixedSecret:
    """A secret given once at start-up (the agent's token, read by its command from a file or the
    environment); reads like a `SecretFile` so one middleware serves both."""

    value: str

    def read(self) -> str:
        return self.value


@dataclass
class Credentials:
    """Accepted credentials: bearer tokens and (optionally) `user:password` lines for basic auth."""

    tokens: tuple[SecretFile | FixedSecret, ...] = ()
    basic: SecretFile | None = None

    def accepts(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, value = header.strip().partition(" ")
        value = value.strip()
        if not value:
            return False
        if scheme.lower() == "bearer":
            ok = False
            for token in self.tokens:
                expected = token.read()
                # compare every configured token: timing must not depend on which one matched
                ok |= bool(expected) and hmac.compare_digest(value.encode(), expected.encode())
            return ok
        if scheme.lower() == "basic" and self.basic is not None:
            try:
                user, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                return False
            if not sep:
                return False
            ok = False
            for u, p in _basic_pairs(self.basic.read()):
                ok |= hmac.compare_digest(user.encode(), u.encode()) & hmac.compare_digest(password.encode(), p.encode())
            return ok
        return False


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(credentials: Credentials, open_paths: Iterable[str] = OPEN_PATHS, *, realm: str = "gpulens",
                    on_refused: Callable[[web.Request], None] | None = None):
    """401 for every path outside `open_paths` without an accepted credential; `on_refused` (a log line)
    sees each refusal."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_set or credentials.accepts(request.headers.get("Authorization")):
            return await handler(request)
        if on_refused is not None:
            on_refused(request)
        challenge = f'Bearer realm="{realm}"' + (f', Basic realm="{realm}"' if credentials.basic else "")
        return web.json_response({"error": "unauthorized"}, status=401, headers={"WWW-Authenticate": challenge})

    return check
