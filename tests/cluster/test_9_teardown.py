"""`down` gives the machine back exactly as it was (sysctls, KUBE-* chains, kubepods cgroups,
mounts, netns, the bridge, processes, state dirs), and a warm `up` afterwards is fast.

Runs after the other cluster tests of this directory (file order) and leaves the cluster up."""

from __future__ import annotations

import dataclasses

import pytest

from .harness import RUN, cluster_sh, down, machine_state, up

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]


def test_down_restores_machine_then_warm_up(cluster, api, capsys):
    during = machine_state()
    before = cluster.before
    # The check below is only worth something if `up` really changed each of these.
    for field in ("kube_chains", "kubepods_cgroups", "links", "processes", "state_dirs"):
        assert getattr(during, field) != getattr(before, field), f"up did not change {field}"
    assert dict(during.sysctls)["vm.overcommit_memory"] == "1"        # set by the kubelet

    # A sysctl someone else on this machine set after our `up` is theirs: down leaves it alone.
    ours = dict(line.split("=", 1) for line in (RUN / "sysctls.ours").read_text().split())
    theirs = {k for k, v in during.sysctls if ours.get(k, v) != v}
    down_s = down()
    after = machine_state()
    diffs = {f.name: (getattr(before, f.name), getattr(after, f.name))
             for f in dataclasses.fields(after) if f.name != "sysctls" and getattr(before, f.name) != getattr(after, f.name)}
    diffs.update({k: (v, dict(after.sysctls).get(k)) for k, v in before.sysctls
                  if k not in theirs and dict(after.sysctls).get(k) != v})
    assert not diffs, f"down left the machine changed: {diffs}"
    assert cluster_sh("status").returncode != 0

    warm_s = up()
    assert cluster_sh("status").returncode == 0
    with capsys.disabled():
        print(f"\n[cluster] first up {cluster.up_s:.1f}s, down {down_s:.1f}s, warm up {warm_s:.1f}s")
