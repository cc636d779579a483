"""argparse value types shared by the components' command lines."""

from __future__ import annotations

import argparse

__all__ = ["host_port", "HostPortError"]


class HostPortError(argparse.ArgumentTypeError, ValueError):
    """A bad HOST:PORT: argparse prints its message; callers parsing at run time catch ValueError."""


def host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) -> (host, port); a clear argparse error otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HostPortError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)
