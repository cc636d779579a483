"""cgroup line formats seen on real nodes (reference/ebpf-gpu-signals.md §4) -> pod UID, container ID."""

from __future__ import annotations

import pytest

from gpulens.exporter.cgroups import parse_cgroup

CID = "acb62391578595ec849d87d8556369cee7f935f0425097fd5f870df0e8aabd3c"
CID2 = "cde6dfaf5007a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a"


@pytest.mark.parametrize("text, uid, cid, runtime, version", [
    # cgroup v2, systemd driver, containerd (EKS), Burstable
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poddde1244b_5bb5_4297_b544_85f3bc0d80bf.slice/"
     f"cri-containerd-{CID}.scope\n",
     "dde1244b-5bb5-4297-b544-85f3bc0d80bf", CID, "containerd", 2),
    # cgroup v2, systemd driver, CRI-O, Guaranteed (no QoS level)
    (f"0::/kubepods.slice/kubepods-pod4a163a05_439d_484b_8e53_2968bc15824f.slice/crio-{CID}.scope\n",
     "4a163a05-439d-484b-8e53-2968bc15824f", CID, "cri-o", 2),
    # CRI-O BestEffort, with the container's own init sub-cgroup below the scope
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod4a163a05_439d_484b_8e53_2968bc15824f.slice/"
     f"crio-{CID}.scope/container\n",
     "4a163a05-439d-484b-8e53-2968bc15824f", CID, "cri-o", 2),
    # cgroupfs driver (GKE), v1-style path in the unified hierarchy
    (f"0::/kubepods/burstable/pod4a163a05-439d-484b-8e53-2968bc15824f/{CID2}\n",
     "4a163a05-439d-484b-8e53-2968bc15824f", CID2, None, 2),
    # cgroup v1, full file, cgroupfs driver, BestEffort
    ("12:hugetlb:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/" + CID + "\n"
     "11:devices:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/" + CID + "\n"
     "4:memory:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/" + CID + "\n"
     "1:name=systemd:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/" + CID + "\n",
     "74c13223-5a00-11e9-b385-42010a80018d", CID, None, 1),
    # cgroup v1 with the systemd driver and Docker shim
    ("3:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod74c13223_5a00_11e9_b385_"
     f"42010a80018d.slice/docker-{CID}.scope\n",
     "74c13223-5a00-11e9-b385-42010a80018d", CID, "docker", 1),
    # hybrid host: empty unified line, containers on v1 controllers
    ("0::/\n"
     f"4:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poddde1244b_5bb5_4297_b544_85f3bc0d80bf.slice/"
     f"cri-containerd-{CID}.scope\n",
     "dde1244b-5bb5-4297-b544-85f3bc0d80bf", CID, "containerd", 1),
    # containerd with SystemdCgroup, as seen in nested (kind) nodes: slice:prefix:id
    ("0::/system.slice/containerd.service/kubepods-burstable-poddde1244b_5bb5_4297_b544_85f3bc0d80bf.slice:"
     f"cri-containerd:{CID}\n",
     "dde1244b-5bb5-4297-b544-85f3bc0d80bf", CID, "containerd", 2),
    # reader in a private cgroup namespace: relative path, static pod (32-hex UID)
    (f"0::/../../pode039200acb850c82bb901653cc38ff6e/{CID}\n",
     "e039200acb850c82bb901653cc38ff6e", CID, None, 2),
    # Docker without Kubernetes: cgroupfs and systemd forms
    (f"4:memory:/docker/{CID}\n", None, CID, "docker", 1),
    (f"2:cpuacct,cpu:/system.slice/docker-{CID}.scope\n", None, CID, "docker", 1),
    # Podman
    (f"0::/machine.slice/libpod-{CID}.scope/container\n", None, CID, "podman", 2),
    # a plain host process
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None, None, None, 2),
])
def test_real_cgroup_formats(text, uid, cid, runtime, version):
    ident = parse_cgroup(text)
    assert (ident.pod_uid, ident.container_id, ident.runtime, ident.version) == (uid, cid, runtime, version)


def test_conmon_scope_is_not_a_container():
    """CRI-O's conmon runs in crio-conmon-<id>.scope: it belongs to the pod, but it is not the container."""
    ident = parse_cgroup("0::/kubepods.slice/kubepods-pod4a163a05_439d_484b_8e53_2968bc15824f.slice/"
                         f"crio-conmon-{CID}.scope\n")
    assert ident.pod_uid == "4a163a05-439d-484b-8e53-2968bc15824f"
    assert ident.container_id is None


@pytest.mark.parametrize("text", ["", "garbage", "0::", "no colons here\n\n", "1:cpu\n",
                                  "0::/kubepods/podnot-a-uid/xyz\n", f"0::/kubepods/pod{'a' * 31}/{CID[:-1]}\n"])
def test_malformed_or_foreign_lines_yield_nothing(text):
    ident = parse_cgroup(text)
    assert ident.pod_uid is None and ident.container_id is None


def test_uid_must_be_followed_by_a_boundary():
    # a UID-looking prefix of a longer token is not a pod UID
    assert parse_cgroup("0::/kubepods/pod4a163a05-439d-484b-8e53-2968bc15824fXYZ/abc\n").pod_uid is None
