"""The node's kernel-header mounts are optional: without them the image's bundled headers are used
(exporter/kheaders.py; the real compile in a container is tests/container/test_exporter_container.py)."""

from __future__ import annotations

from .chart import containers, one, render, validate


def _ds(values=None):
    return one(render(values), "DaemonSet", "-node")


def _host_paths(ds) -> set[str]:
    return {v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}


def _mounts(ds) -> set[str]:
    return {m["mountPath"] for m in containers(ds)["exporter"]["volumeMounts"]}


def test_host_headers_mounted_by_default():
    ds = _ds()
    assert {"/lib/modules", "/usr/src"} <= _host_paths(ds)
    assert {"/lib/modules", "/usr/src"} <= _mounts(ds)


def test_nodes_without_headers_mount_neither():
    ds = _ds({"exporter": {"hostKernelHeaders": False}})
    validate(ds)
    assert not {"/lib/modules", "/usr/src"} & _host_paths(ds)
    assert not {"/lib/modules", "/usr/src"} & _mounts(ds)
    assert "/sys/kernel/debug" in _mounts(ds)       # the rest of the exporter's mounts stay


def test_no_exporter_no_header_volumes():
    ds = _ds({"exporter": {"enabled": False}})
    assert not {"/lib/modules", "/usr/src"} & _host_paths(ds)


def test_image_tag_defaults_to_the_chart_app_version():
    import yaml
    from .chart import CHART_DIR
    app = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    images = {c["image"] for c in containers(_ds({"image": {"repository": "registry.example.com/gpulens"}})).values()}
    assert images == {f"registry.example.com/gpulens:{app}"}


def test_nvml_is_the_real_one_by_default_and_mounts_nothing():
    ds = _ds()
    args = containers(ds)["exporter"]["args"]
    assert "--nvml=auto" in args
    assert not [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "nvml-stub"]


def test_a_stub_nvml_folder_is_mounted_read_only_from_the_node_at_its_own_path():
    """exporter.nvml stub:<folder> (the test cluster: no GPU, trainers drive the CUDA stand-in): the
    exporter reads the stand-in's per-process files where the node's trainers write them."""
    folder = "/var/lib/gpulens-cluster/node/stub-gpu"
    ds = _ds({"exporter": {"nvml": f"stub:{folder}"}})
    validate(ds)
    exp = containers(ds)["exporter"]
    assert f"--nvml=stub:{folder}" in exp["args"]
    (mount,) = [m for m in exp["volumeMounts"] if m["name"] == "nvml-stub"]
    assert mount == {"name": "nvml-stub", "mountPath": folder, "readOnly": True}
    (vol,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "nvml-stub"]
    assert vol["hostPath"]["path"] == folder
    assert "nvml-stub" not in {m["name"] for m in containers(ds)["agent"]["volumeMounts"]}
