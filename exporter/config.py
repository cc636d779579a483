"""The exporter's settings, one typed value passed down from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExporterConfig", "parse_listen", "DEFAULT_LIBRARY_GLOBS"]

DEFAULT_LIBRARY_GLOBS = ("libcuda.so*",)


def parse_listen(text: str) -> tuple[str, int]:
    """"HOST:PORT", "[::1]:PORT" or ":PORT" (all interfaces) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, not {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


@dataclass(frozen=True)
class ExporterConfig:
    node: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 9450
    proc_root: Path = Path("/proc")
    library_globs: tuple[str, ...] = DEFAULT_LIBRARY_GLOBS
    ebpf: bool = True
    max_processes: int = 16384
    max_inflight: int = 65536
    scan_interval_s: float = 2.0
    rescan_interval_s: float = 5.0
    attribution_grace_s: float = 10.0
    retired_ttl_s: float = 900.0
    registry_dir: Path | None = None
    kubernetes: bool = False
    kubeconfig: str | None = None
    nvml: str = "auto"                     # auto | off | stub:DIR
    dcgm_url: str | None = None
    dcgm_interval_s: float = 10.0
    #: find dcgm-exporter on this node through the Kubernetes API when no dcgm_url is given
    #: (None: no API to ask; dcgm_discovery_off says why)
    dcgm_discovery: bool = False
    dcgm_discovery_off: str = "no --dcgm-url given"
    dcgm_namespaces: tuple[str, ...] = ()  # where to look; () = all namespaces
