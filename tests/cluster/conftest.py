"""The session's real cluster: brought up once for every test marked `cluster`, taken down at the end.

Needs root (network, cgroups, containerd). Off CI a machine that cannot run it skips these tests;
under CI=true that is a failure (the cluster is a required real component)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

import subprocess
import sys

from .harness import (BB, KUBECONFIG, REPO, TOOLBOX, MachineState, cluster_sh, down, machine_state, readme_install,
                      up, wait_until)

#: The node's address on the pod bridge: pods reach the host there (the apiserver, DNS, and the
#: tests' S3 server).
NODE_IP = "10.244.0.1"
S3_BUCKET = "gpulens-cluster"
S3_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Cluster:
    kubeconfig: str
    before: MachineState       # the machine before `up`: what `down` must restore
    up_s: float


#: Development only: `GPULENS_CLUSTER_REUSE=1` keeps the cluster (and the release) between pytest
#: sessions: a Ready cluster is used as it is and left running. Never under CI, and never with
#: test_1_node/test_9_teardown, which check `down` against the machine as it was before `up`.
REUSE = os.environ.get("GPULENS_CLUSTER_REUSE") == "1" and os.environ.get("CI") != "true"


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the cluster tests need root (CI runs as root)")
        pytest.skip("the cluster tests need root")
    if REUSE:
        before = machine_state()
        up_s = 0.0 if cluster_sh("status").returncode == 0 else up()
        yield Cluster(str(KUBECONFIG), before, up_s)
        return
    down()                      # leftovers of an interrupted run would poison the baseline
    before = machine_state()
    try:
        up_s = up()
    except Exception:
        down()
        raise
    yield Cluster(str(KUBECONFIG), before, up_s)
    down()


@pytest.fixture(scope="session")
def api(cluster: Cluster):
    from kubernetes import client, config
    return client.CoreV1Api(config.new_client_from_config(config_file=cluster.kubeconfig))


@pytest.fixture(scope="session")
def toolbox(cluster, tmp_path_factory) -> str:
    """A busybox image built from Debian's busybox-static (no registry here), loaded into the node."""
    out = tmp_path_factory.mktemp("toolbox") / "toolbox.tar"
    subprocess.run([sys.executable, str(REPO / "cluster" / "oci_image.py"), "--ref", TOOLBOX, "--out", str(out),
                    "--entrypoint", BB, f"{BB}:bin/busybox"], check=True, capture_output=True)
    r = cluster_sh("load", str(out))
    assert r.returncode == 0, r.stderr
    return TOOLBOX


@pytest.fixture(scope="session")
def gpulens_image(cluster, tmp_path_factory) -> str:
    """The image/ room's image, built (cached by its context hash) and imported into the node."""
    if not (REPO / "image" / "build.sh").exists():
        pytest.fail("image/build.sh is missing: the cluster runs the image from the image room")
    r = subprocess.run(["bash", str(REPO / "image" / "build.sh")], capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-6000:]
    name = r.stdout.strip().splitlines()[-1]
    tar = tmp_path_factory.mktemp("image") / "gpulens.tar"
    s = subprocess.run(["bash", str(REPO / "image" / "podman"), "save", "-o", str(tar), name],
                       capture_output=True, text=True, timeout=900)
    assert s.returncode == 0, s.stderr
    r = cluster_sh("load", str(tar), timeout=900)
    assert r.returncode == 0, r.stderr
    tar.unlink()
    return name


@dataclass
class S3:
    endpoint: str       # as pods reach it
    bucket: str

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_CREDS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_CREDS["AWS_SECRET_ACCESS_KEY"],
                            region_name=S3_CREDS["AWS_DEFAULT_REGION"])


@pytest.fixture(scope="session")
def s3(cluster):
    """A moto S3 server (a real S3 wire protocol server) on the node's bridge address, where the
    agent and coordinator pods reach it: the archive of the loop tests."""
    from tests.conftest import free_port
    from tests.s3server import stop_process
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", NODE_IP, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = S3(f"http://{NODE_IP}:{port}", S3_BUCKET)
    try:
        wait_until("moto S3 server", lambda: proc.poll() is None and store.client().list_buckets(), 60, 0.2)
        store.client().create_bucket(Bucket=S3_BUCKET)
        yield store
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def release(cluster, api, gpulens_image, s3):
    """The chart installed once per session by the README's own lines (values file, kubectl and
    helm commands: tests/cluster/readme_install.py), archiving to the S3 server.

    Not uninstalled: the cluster's `down` (test_9, then the session's end) takes every object with
    it, and test_9 checks `down` with the release running."""
    install = readme_install(gpulens_image, s3.endpoint)
    out = install.run(api, cluster.kubeconfig, REPO, exists_ok=lambda status: REUSE and status == 409)
    if REUSE:
        _restart_release_pods(api)
    return out


def _restart_release_pods(api) -> None:
    """A kept cluster's pods may run another worktree's image under the same tag (an upgrade
    restarts only pods whose spec changed): start every release pod again from the loaded image."""
    from .harness import NS
    old = {p.metadata.uid for p in api.list_namespaced_pod(NS).items}
    api.delete_collection_namespaced_pod(NS, grace_period_seconds=0)

    def fresh_and_ready():
        pods = api.list_namespaced_pod(NS).items
        return pods and all(p.metadata.uid not in old and p.status.container_statuses
                            and all(c.ready for c in p.status.container_statuses) for p in pods)
    wait_until("the release's pods restarted and Ready", fresh_and_ready, 300, 1)
