"""A file:// archive on a single node: every pod that writes or reads the archive mounts the same
host folder at the same path (issue 31: the agent retried on "Read-only file system" and the
coordinator could not write its manifest, because nothing mounted it).

Followed through the real pieces: the chart's render (node DaemonSet, operator ConfigMap), the
operator's coordinator Pod built from that ConfigMap, the `gpulens coordinator` command line that
Pod runs, and the analysis Job that command line builds."""

from __future__ import annotations

import pytest
import yaml
from helm_python import HelmValuesError
from kubernetes import client

from gpulens.capture.coordinator.analysis_job import analysis_job
from gpulens.capture.coordinator.command import analysis_for
from gpulens.capture.operator.config import OperatorConfig
from gpulens.capture.operator.jobs import job_of_pod
from gpulens.capture.operator.manifests import coordinator_pod, coordinator_resource
from gpulens.cli import build_subparser

from .chart import one, render, validate

ROOT = "file:///var/lib/gl-archive/"
HOST = "/var/lib/gl-archive"


def _archive_mounts(pod_spec: dict, container: str) -> list[tuple[str, str | None, bool]]:
    """(mountPath, hostPath, readOnly) of every hostPath mount of the archive folder in `container`."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    c = next(c for c in pod_spec["containers"] if c["name"] == container)
    out = []
    for m in c.get("volumeMounts", []):
        host = (volumes[m["name"]].get("hostPath") or {}).get("path")
        if host == HOST or m["mountPath"] == HOST:
            out.append((m["mountPath"], host, bool(m.get("readOnly"))))
    return out


def _chain(root: str) -> tuple[dict, dict, dict]:
    """(node pod spec, coordinator pod, analysis Job) for a chart installed with archive.root=root."""
    objs = render({"archive": {"root": root}})
    node = one(objs, "DaemonSet", "-node")["spec"]["template"]["spec"]
    config = OperatorConfig.from_dict(yaml.safe_load(one(objs, "ConfigMap", "-operator")["data"]["operator.yaml"]))
    trainer = {"metadata": {"name": "llama-0", "namespace": "ml", "labels": {"gpulens.dev/armed": "true",
                                                                         "gpulens.dev/job": "llama"}}}
    cc = coordinator_resource(job_of_pod(trainer), 0, [trainer], config)
    cc["metadata"]["uid"] = "cc-uid"
    pod = coordinator_pod(cc, config)
    argv = pod["spec"]["containers"][0]["args"]
    parser, _ = build_subparser(argv[0])
    runner = analysis_for(parser.parse_args(argv[1:]), api_client=client.ApiClient())
    job = analysis_job(runner.spec, root.rstrip("/") + "/ml/llama/0/c1/manifest.json", "c1")
    return node, pod, job


def test_file_archive_is_the_same_writable_host_folder_in_agent_coordinator_and_analysis():
    node, pod, job = _chain(ROOT)
    job_pod = job["spec"]["template"]["spec"]
    for spec, container in ((node, "agent"), (pod["spec"], "coordinator"), (job_pod, "analyze")):
        assert _archive_mounts(spec, container) == [(HOST, HOST, False)], container
    agent = next(c for c in node["containers"] if c["name"] == "agent")
    assert f"--archive-root={ROOT}" in agent["args"]
    # The agent (root) owns what it writes; the coordinator and the analysis write beside it.
    for spec in (pod["spec"], job_pod):
        assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
    for body in (pod, job):
        assert validate(body)


def test_s3_archive_mounts_no_host_folder_and_stays_non_root():
    node, pod, job = _chain("s3://gpulens/captures")
    job_pod = job["spec"]["template"]["spec"]
    for spec, container in ((node, "agent"), (pod["spec"], "coordinator"), (job_pod, "analyze")):
        assert not [v for v in spec["volumes"] if v["name"] == "archive"], container
    for spec in (pod["spec"], job_pod):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65532


@pytest.mark.parametrize("root", ["file://nas/archive", "file://archive", "file:///", "s3://", "s3:///key",
                                  "/var/lib/archive"])
def test_archive_roots_the_archive_would_refuse_are_refused_by_the_schema(root):
    with pytest.raises(HelmValuesError) as err:
        render({"archive": {"root": root}})
    assert "/archive/root" in str(err.value)
