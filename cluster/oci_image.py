"""Write a one-layer OCI image archive (an `oci-layout` tar) that `ctr images import` accepts.

Used for images made of a static binary or two, with no registry to pull from: the pause image
(stands in for registry.k8s.io/pause) and the tests' busybox toolbox. Byte-reproducible (fixed
mtimes, sorted entries), so the same inputs give the same digest.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: object) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


def _layer(files: dict[str, tuple[bytes, int]]) -> tuple[bytes, bytes]:
    """Return (uncompressed tar, gzip) of the files, with fixed mtimes so the digest is stable."""
    raw = io.BytesIO()
    dirs = sorted({str(Path(n).parents[i]) for n in files for i in range(len(Path(n).parents) - 1)})
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as f:
        f.write(plain)
    return plain, gz.getvalue()


def build(files: dict[str, Path], ref: str, out: Path, *, entrypoint: list[str], user: str = "") -> str:
    """Write the archive; `files` maps a path inside the image to a host file. Returns the manifest digest."""
    plain, gz = _layer({dest.lstrip("/"): (src.read_bytes(), 0o755) for dest, src in files.items()})
    layer = Blob("application/vnd.oci.image.layer.v1.tar+gzip", gz)
    config = Blob("application/vnd.oci.image.config.v1+json", json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "User": user},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(plain).hexdigest()]},
    }, sort_keys=True).encode())
    manifest = Blob("application/vnd.oci.image.manifest.v1+json", json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config.descriptor(), "layers": [layer.descriptor()],
    }, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [manifest.descriptor(
        annotations={"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": ref})]}
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for blob in (layer, config, manifest):
            add("blobs/sha256/" + blob.digest.split(":", 1)[1], blob.data)
    return manifest.digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ref", required=True, help="image name, e.g. localhost/gpulens-pause:1")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--entrypoint", required=True, help="path inside the image")
    ap.add_argument("--user", default="")
    ap.add_argument("files", nargs="+", metavar="HOST_FILE:IMAGE_PATH")
    a = ap.parse_args()
    files = {}
    for spec in a.files:
        src, _, dest = spec.partition(":")
        if not dest:
            ap.error(f"expected HOST_FILE:IMAGE_PATH, got {spec!r}")
        files[dest] = Path(src)
    print(build(files, a.ref, a.out, entrypoint=[a.entrypoint], user=a.user))


if __name__ == "__main__":
    main()
