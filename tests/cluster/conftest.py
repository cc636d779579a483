"""The session's real cluster: brought up once for every test marked `cluster`, taken down at the end.

Needs root (network, cgroups, containerd). Off CI a machine that cannot run it skips these tests;
under CI=true that is a failure (the cluster is a required real component)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

import subprocess
import sys

from .harness import BB, KUBECONFIG, REPO, TOOLBOX, MachineState, cluster_sh, down, machine_state, up


@dataclass
class Cluster:
    kubeconfig: str
    before: MachineState       # the machine before `up`: what `down` must restore
    up_s: float


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the cluster tests need root (CI runs as root)")
        pytest.skip("the cluster tests need root")
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
