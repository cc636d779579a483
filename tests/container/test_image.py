"""The image itself: what it contains, and every non-node component started in it as the chart
runs them (uid 65532, read-only root filesystem, all capabilities dropped, no new privileges).

- `gpulens --help` is the default command; the user has a passwd entry (kopf asks getpass.getuser());
- coordinator and gateway answer /healthz;
- the operator, against the test API server (tests/operator/apiserver.py, the same double the
  operator's own tests use), answers /healthz, wins its Lease and creates a job's coordinator;
- `gpulens analyze` analyses a real manifest (HTA's genuine 2-rank GPU traces) and writes its
  report next to it.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, RESTRICTED, podman, wait_http
from tests.conftest import free_port

pytestmark = [pytest.mark.container, pytest.mark.root]

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _readable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o644)
    return path


def test_image_config(image):
    cfg = json.loads(podman("image", "inspect", image).stdout)[0]
    c = cfg["Config"]
    assert image == f"localhost/gpulens:{VERSION}"
    assert c["User"] == "65532:65532"
    assert c["Entrypoint"] == ["gpulens"]
    labels = c["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.title"] == "gpulens"
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["GPULENS_KERNEL_HEADERS"] == "/usr/lib/gpulens/kernel-headers"
    # What the proxy needs at build time must not end up in the image.
    assert not any("proxy" in k.lower() for k in env)


def test_default_command_is_help_as_non_root(image, containers):
    done = containers.run("help", image, run_opts=RESTRICTED)
    assert done.returncode == 0, done.stderr
    for sub in ("exporter", "agent", "coordinator", "gateway", "operator", "analyze", "capture"):
        assert sub in done.stdout


PROBE = r"""
import getpass, importlib.util, json, os, pwd
mods = ["bcc", "hta.trace_analysis", "gpulens.capture.analysis", "gpulens.exporter.probes", "kopf", "torch",
        "jupyterlab", "notebook", "pytest", "moto", "kmock", "pip"]
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "user": getpass.getuser(),
                  "home": pwd.getpwuid(os.getuid()).pw_dir,
                  "found": {m: importlib.util.find_spec(m.split(".")[0]) is not None for m in mods},
                  "headers": os.path.isfile("/usr/lib/gpulens/kernel-headers/include/linux/kconfig.h"),
                  "root_writable": os.access("/", os.W_OK)}))
"""


def test_contents_runtime_only_with_a_named_user(image, containers):
    done = containers.run("probe", image, "-c", PROBE, run_opts=(*RESTRICTED, "--entrypoint", "python3"))
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["uid"], got["gid"], got["user"]) == (65532, 65532, "gpulens")
    found = got["found"]
    assert all(found[m] for m in ("bcc", "hta.trace_analysis", "gpulens.capture.analysis", "gpulens.exporter.probes", "kopf"))
    assert not any(found[m] for m in ("torch", "jupyterlab", "notebook", "pytest", "moto", "kmock", "pip")), found
    assert got["headers"] is True
    assert got["root_writable"] is False


def test_coordinator_and_gateway_answer_healthz(image, containers, tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    secrets.chmod(0o755)
    for name in ("coordinator", "agent", "gateway"):
        _readable(secrets / name, f"{name}-token\n")
    archive = tmp_path / "archive"
    archive.mkdir()
    os.chown(archive, 65532, 65532)
    registry = tmp_path / "registry"
    registry.mkdir()
    registry.chmod(0o755)
    mounts = ("-v", f"{secrets}:/var/run/gpulens/tokens:ro", "-v", f"{archive}:/archive",
              "-v", f"{registry}:/var/lib/gpulens/registry:ro")
    cport, gport = free_port(), free_port()
    coord = containers.start("coordinator", image, "coordinator", f"--listen=127.0.0.1:{cport}", "--job=train",
                             "--attempt=0", "--namespace=ml", "--discovery=local",
                             "--registry-dir=/var/lib/gpulens/registry", "--agent-url=http://127.0.0.1:9",
                             "--archive-root=file:///archive", "--token-file=/var/run/gpulens/tokens/coordinator",
                             "--agent-token-file=/var/run/gpulens/tokens/agent", "--state-dir=/tmp/state",
                             run_opts=(*RESTRICTED, *mounts))
    gw = containers.start("gateway", image, "gateway", f"--listen=127.0.0.1:{gport}",
                          "--token-file=/var/run/gpulens/tokens/gateway",
                          f"--route=ml/train=http://127.0.0.1:{cport}",
                          "--coordinator-token-file=/var/run/gpulens/tokens/coordinator", "--state-dir=/tmp/gw",
                          run_opts=(*RESTRICTED, *mounts))
    wait_http(f"http://127.0.0.1:{cport}/healthz", coord)
    wait_http(f"http://127.0.0.1:{gport}/healthz", gw)
    # The gateway reaches the coordinator in its container with the token (not just /healthz).
    from .conftest import http_get
    status, body = http_get(f"http://127.0.0.1:{cport}/v1/captures",
                            headers={"Authorization": "Bearer coordinator-token"})
    assert status == 200, body
    status, _ = http_get(f"http://127.0.0.1:{cport}/v1/captures", headers={"Authorization": "Bearer wrong"})
    assert status == 401


@pytest.mark.slow
def test_operator_leads_and_creates_a_coordinator(image, containers, tmp_path):
    from tests.operator.apiserver import running_apiserver
    from tests.operator.conftest import OPERATOR_NS, Cluster
    from tests.operator.test_kopf_operator import _wait

    with running_apiserver() as api:
        cluster = Cluster(api)
        cluster.tokens()
        kubeconfig = _readable(tmp_path / "kubeconfig", yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": api.url}}],
            "users": [{"name": "test", "user": {}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
        config = _readable(tmp_path / "operator.yaml", yaml.safe_dump({
            "namespace": OPERATOR_NS, "image": image, "tokens_secret": "gl-gpulens-tokens",
            "resync_interval_s": 1,
            "leader_election": {"lease_name": "gpulens-operator", "lease_duration_s": 4, "renew_period_s": 0.3},
            "coordinator": {"archive_root": "s3://traces/gpulens"}}))
        port = free_port()
        op = containers.start("operator", image, "operator", "--config=/etc/gpulens/operator.yaml",
                              "--kubeconfig=/etc/gpulens/kubeconfig", f"--listen=127.0.0.1:{port}",
                              run_opts=(*RESTRICTED, "-v", f"{config}:/etc/gpulens/operator.yaml:ro",
                                        "-v", f"{kubeconfig}:/etc/gpulens/kubeconfig:ro"))
        wait_http(f"http://127.0.0.1:{port}/healthz", op)
        job = cluster.job("ml", "llama")
        cluster.pod("ml", "llama-0", job=job)
        _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the operator to create the coordinator")
        assert op.running(), op.logs()
        assert "getpwuid" not in op.logs()


def test_analyze_a_real_manifest(image, containers, tmp_path):
    from tests.analysis.conftest import SHARED_TRACES, CaptureBuilder

    d = SHARED_TRACES / "hta_trace_filter_2rank"
    if not d.is_dir():
        pytest.skip(f"shared trace data not found at {d}")
    root = tmp_path / "archive"
    # The manifest names file:// URIs: mount the archive at the same path inside the container.
    b = CaptureBuilder(root=root)
    b.add(0, d / "sampled_rank-0.json.gz").add(1, d / "sampled_rank-1.json.gz")
    capture = b.write()
    for p in [root, *root.rglob("*")]:
        os.chown(p, 65532, 65532)
    done = containers.run("analyze", image, "analyze", capture.manifest_uri, "--jobs", "2",
                          run_opts=(*RESTRICTED, "-v", f"{root}:{root}"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("analysis/report.html")
    summary = capture.summary()
    assert summary["status"] == "analysed" and summary["trace_kind"] == "gpu"
    assert sorted(r["rank"] for r in summary["ranks"] if r.get("included", True)) == [0, 1]
    assert (capture.dir / "analysis" / "report.html").stat().st_size > 10_000
