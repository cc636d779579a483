"""Offline tests of the harness's own pieces (no cluster, no root): the DNS feeder's records and
the OCI archive writer. Not marked `cluster`: they run everywhere."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

from .harness import REPO

sys.path.insert(0, str(REPO / "cluster"))
import dns_feed  # noqa: E402
import oci_image  # noqa: E402


def _svc(ns, name, ip):
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"clusterIP": ip}}


def test_cluster_ip_services_get_one_record_each():
    svcs = {"items": [_svc("default", "kubernetes", "10.96.0.1"), _svc("gpulens-system", "gl-gateway", "10.96.4.2")]}
    assert dns_feed.hosts_lines(svcs, {"items": []}, "cluster.local") == [
        "10.96.0.1 kubernetes.default.svc.cluster.local",
        "10.96.4.2 gl-gateway.gpulens-system.svc.cluster.local"]


def test_headless_service_resolves_to_ready_endpoints_only():
    svcs = {"items": [_svc("ml", "coord", "None")]}
    eps = {"items": [{"metadata": {"namespace": "ml", "name": "coord"},
                      "subsets": [{"addresses": [{"ip": "10.244.0.7"}, {"ip": "10.244.0.9"}],
                                   "notReadyAddresses": [{"ip": "10.244.0.8"}]}]}]}
    assert dns_feed.hosts_lines(svcs, eps, "cluster.local") == [
        "10.244.0.7 coord.ml.svc.cluster.local", "10.244.0.9 coord.ml.svc.cluster.local"]


def test_headless_without_endpoints_and_same_name_other_namespace_get_nothing():
    svcs = {"items": [_svc("ml", "coord", "None"), _svc("other", "web", "")]}
    eps = {"items": [{"metadata": {"namespace": "other", "name": "coord"}, "subsets": [{"addresses": [{"ip": "10.244.0.5"}]}]}]}
    assert dns_feed.hosts_lines(svcs, eps, "cluster.local") == []


def test_write_atomic_reports_changes_only(tmp_path):
    (tmp_path / "dns").mkdir()
    f = tmp_path / "dns" / "services"
    assert dns_feed.write_atomic(f, "a\n") is True
    assert dns_feed.write_atomic(f, "a\n") is False
    assert dns_feed.write_atomic(f, "b\n") is True and f.read_text() == "b\n"
    assert [p.name for p in (tmp_path / "dns").iterdir()] == ["services"]     # dnsmasq never sees a temp file


def _read(archive: Path) -> tuple[dict, dict, tarfile.TarFile]:
    outer = tarfile.open(archive)
    blob = lambda d: outer.extractfile("blobs/sha256/" + d.split(":")[1]).read()  # noqa: E731
    index = json.loads(outer.extractfile("index.json").read())
    manifest_desc = index["manifests"][0]
    manifest_bytes = blob(manifest_desc["digest"])
    assert hashlib.sha256(manifest_bytes).hexdigest() == manifest_desc["digest"].split(":")[1]
    manifest = json.loads(manifest_bytes)
    config = json.loads(blob(manifest["config"]["digest"]))
    layer = tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][0]["digest"])))
    return index, config, layer


def test_oci_archive_is_valid_and_reproducible(tmp_path):
    exe = tmp_path / "pause"
    exe.write_bytes(b"\x7fELF fake")
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    d1 = oci_image.build({"pause": exe}, "localhost/p:1", a, entrypoint=["/pause"], user="65535:65535")
    d2 = oci_image.build({"pause": exe}, "localhost/p:1", b, entrypoint=["/pause"], user="65535:65535")
    assert d1 == d2 and a.read_bytes() == b.read_bytes()
    index, config, layer = _read(a)
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == "localhost/p:1"
    assert config["config"] == {"Entrypoint": ["/pause"], "User": "65535:65535"}
    member = layer.getmember("pause")
    assert member.mode == 0o755 and layer.extractfile(member).read() == b"\x7fELF fake"
    # the config's diff_id is the digest of the uncompressed layer (containerd checks it)
    exe.write_bytes(b"\x7fELF other")
    assert oci_image.build({"pause": exe}, "localhost/p:1", b, entrypoint=["/pause"]) != d1


def test_oci_archive_has_parent_directories(tmp_path):
    exe = tmp_path / "bb"
    exe.write_bytes(b"x")
    oci_image.build({"bin/busybox": exe}, "localhost/t:1", tmp_path / "t.tar", entrypoint=["/bin/busybox"])
    _, _, layer = _read(tmp_path / "t.tar")
    assert layer.getmember("bin").isdir() and layer.getmember("bin/busybox").isfile()
