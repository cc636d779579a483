"""Which kernel headers bcc compiles the counters program against.

bcc looks in /lib/modules/<release>/{build,source} (then /sys/kernel/kheaders.tar.xz). Many managed
nodes (COS, Bottlerocket, Talos) ship neither, and in the chart the host's /lib/modules and
/usr/src mounts are optional. The program takes its only kernel struct offsets from BTF
(exporter/btf.py), so a generic header tree compiles it correctly on another kernel: the image
bundles Debian's and names it in GPULENS_KERNEL_HEADERS; bcc is pointed at it (BCC_KERNEL_SOURCE)
only when the host has none. bcc reads that variable from the environment, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KernelHeaders", "choose"]

_KCONFIG = Path("include/linux/kconfig.h")      # the file bcc itself checks for


@dataclass(frozen=True)
class KernelHeaders:
    """Where bcc will find headers: `origin` is env | host | kheaders | bundled | none."""
    origin: str
    path: str | None
    #: environment bcc must see for this choice (empty: its own default search finds them)
    env: Mapping[str, str]

    def describe(self) -> str:
        return f"{self.origin} ({self.path})" if self.path else self.origin


def _host_tree(kdir: Path) -> Path | None:
    """The tree bcc's default search uses under /lib/modules/<release>, if it has headers."""
    tree = kdir / "source" if (kdir / "build").is_dir() and (kdir / "source").is_dir() else kdir / "build"
    return tree if (tree / _KCONFIG).is_file() else None


def choose(release: str, environ: Mapping[str, str], *, modules_dir: Path = Path("/lib/modules"),
           kheaders_tar: Path = Path("/sys/kernel/kheaders.tar.xz")) -> KernelHeaders:
    """The host's headers, else the kernel's own archive, else the bundled tree (GPULENS_KERNEL_HEADERS)."""
    if environ.get("BCC_KERNEL_SOURCE"):
        return KernelHeaders("env", environ["BCC_KERNEL_SOURCE"], {})
    host = _host_tree(modules_dir / release)
    if host is not None:
        return KernelHeaders("host", str(host), {})
    if kheaders_tar.is_file():                   # the running kernel's own (CONFIG_IKHEADERS)
        return KernelHeaders("kheaders", str(kheaders_tar), {})
    bundled = environ.get("GPULENS_KERNEL_HEADERS")
    if bundled and (Path(bundled) / _KCONFIG).is_file():
        return KernelHeaders("bundled", bundled, {"BCC_KERNEL_SOURCE": bundled})
    return KernelHeaders("none", None, {})
