"""`down` gives the machine back exactly as it was (sysctls, KUBE-* chains, kubepods cgroups,
mounts, netns, the bridge, processes, state dirs), and a warm `up` afterwards is fast.

Runs after the other cluster tests of this directory (file order) and leaves the cluster up."""

from __future__ import annotations

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
    down_s = down()
    diffs = machine_diff(before, machine_state(), theirs)
    assert not diffs, f"down left the machine changed: {diffs}"
    assert cluster_sh("status").returncode != 0

    warm_s = up()
    assert cluster_sh("status").returncode == 0
    with capsys.disabled():
        print(f"\n[cluster] first up {cluster.up_s:.1f}s, down {down_s:.1f}s, warm up {warm_s:.1f}s")
