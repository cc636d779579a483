"""`down` gives the machine back exactly as it was (sysctls, KUBE-* chains, kubepods cgroups,
mounts, netns, the bridge, processes, state dirs), and a warm `up` afterwards is fast.

Runs after the other cluster tests of this directory (file order) and leaves the cluster up."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from .harness import cluster_sh, down, machine_diff, machine_state, sysctls_changed_by_others, up

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]


def test_down_restores_machine_then_warm_up(cluster, api, capsys):
    during = machine_state()
    before = cluster.before
    # The check below is only worth something if `up` really changed each of these.
    for field in ("kube_chains", "kubepods_cgroups", "links", "processes", "state_dirs"):
        assert getattr(during, field) != getattr(before, field), f"up did not change {field}"
    assert dict(during.sysctls)["vm.overcommit_memory"] == "1"        # set by the kubelet

    # A sysctl someone else on this machine set after our `up` is theirs: down leaves it alone.
    theirs = sysctls_changed_by_others(during)
    # Someone else's network namespace added beside the running cluster, as the soak's nodes
    # (tests/netnodes.py) do in another lane: iproute2's first `ip netns add` bind-mounts /run/netns
    # onto itself, which hid pod sandboxes' netns mounts made there before and broke down (CI run of
    # 2026-12-07: "rm: cannot remove '/run/netns/cni-...': Device or resource busy").
    beside = f"gl-beside-{uuid.uuid4().hex[:6]}"
    was_mount = subprocess.run(["mountpoint", "-q", "/run/netns"], check=False).returncode == 0
    was_dir = os.path.isdir("/run/netns")
    subprocess.run(["ip", "netns", "add", beside], check=True)
    try:
        down_s = down()
    finally:
        subprocess.run(["ip", "netns", "del", beside], check=False)
        if not was_mount:
            subprocess.run(["umount", "/run/netns"], check=False)
        if not was_dir:
            subprocess.run(["rmdir", "/run/netns"], check=False)
    diffs = machine_diff(before, machine_state(), theirs)
    assert not diffs, f"down left the machine changed: {diffs}"
    assert cluster_sh("status").returncode != 0

    warm_s = up()
    assert cluster_sh("status").returncode == 0
    with capsys.disabled():
        print(f"\n[cluster] first up {cluster.up_s:.1f}s, down {down_s:.1f}s, warm up {warm_s:.1f}s")
