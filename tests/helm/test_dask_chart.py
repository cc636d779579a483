"""The chart's Dask cluster for analysis (issue 28, values `dask`), followed through the real
pieces: the chart's render (scheduler and worker Deployments, Service, NetworkPolicy, operator
ConfigMap), the operator's coordinator Pod built from that ConfigMap, the `gpulens coordinator`
command line that Pod runs, the analysis Job that command line builds, and `gpulens analyze`'s own
parser reading that Job's arguments. Off by default: the Job then analyses alone."""

from __future__ import annotations

import pytest
import yaml
from helm_python import HelmValuesError
from kubernetes import client

from gpulens.capture.analysis.dask_map import RETRIES
from gpulens.capture.coordinator.analysis_job import analysis_job
from gpulens.capture.coordinator.command import analysis_for
from gpulens.capture.operator.config import OperatorConfig
from gpulens.capture.operator.jobs import job_of_pod
from gpulens.capture.operator.manifests import coordinator_pod, coordinator_resource
from gpulens.cli import build_subparser

from .chart import NAMESPACE, RELEASE, by_kind, one, render, validate

SCHEDULER = f"tcp://{RELEASE}-gpulens-dask-scheduler.{NAMESPACE}.svc:8786"


def _job(values: dict) -> dict:
    """The analysis Job a coordinator made by this chart's operator creates for one capture."""
    objs = render(values)
    config = OperatorConfig.from_dict(yaml.safe_load(one(objs, "ConfigMap", "-operator")["data"]["operator.yaml"]))
    trainer = {"metadata": {"name": "llama-0", "namespace": "ml", "labels": {"gpulens.dev/armed": "true",
                                                                         "gpulens.dev/job": "llama"}}}
    cc = coordinator_resource(job_of_pod(trainer), 0, [trainer], config)
    cc["metadata"]["uid"] = "cc-uid"
    argv = coordinator_pod(cc, config)["spec"]["containers"][0]["args"]
    parser, _ = build_subparser(argv[0])
    runner = analysis_for(parser.parse_args(argv[1:]), api_client=client.ApiClient())
    return analysis_job(runner.spec, "s3://gpulens/captures/ml/llama/0/c1/manifest.json", "c1")


def _analyze_args(job: dict):
    """`gpulens analyze`'s own parse of the Job container's arguments."""
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["gpulens"] and c["args"][0] == "analyze"
    parser, _ = build_subparser("analyze")
    return parser.parse_args(c["args"][1:])


def _dask(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["__template__"].endswith("/dask.yaml")]


def test_off_by_default_no_dask_objects_and_the_job_analyses_alone():
    assert _dask(render({})) == []
    assert _analyze_args(_job({})).scheduler is None


def test_enabled_the_analysis_job_submits_to_the_charts_scheduler_service():
    values = {"dask": {"enabled": True}}
    objs = render(values)
    for o in _dask(objs):
        assert validate(o)
    svc = one(objs, "Service", "-dask-scheduler")
    sched = one(objs, "Deployment", "-dask-scheduler")
    host, port = SCHEDULER.removeprefix("tcp://").rsplit(":", 1)
    assert f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc" == host
    assert [p["port"] for p in svc["spec"]["ports"]] == [int(port)]
    assert svc["spec"]["selector"].items() <= sched["spec"]["template"]["metadata"]["labels"].items()
    assert _analyze_args(_job(values)).scheduler == SCHEDULER


def test_an_existing_scheduler_is_used_without_deploying_one():
    """dask.existingScheduler: a cluster the user runs (e.g. a DaskCluster of the Dask Kubernetes
    Operator); the chart deploys nothing for it. The chart's own wins when enabled."""
    mine = "tcp://analysis-scheduler.dask.svc:8786"
    objs = render({"dask": {"existingScheduler": mine}})
    assert _dask(objs) == []
    assert _analyze_args(_job({"dask": {"existingScheduler": mine}})).scheduler == mine
    assert _analyze_args(_job({"dask": {"enabled": True, "existingScheduler": mine}})).scheduler == SCHEDULER


def test_scheduler_and_workers_run_gpulens_image_and_workers_join_that_service():
    objs = render({"dask": {"enabled": True, "workers": {"replicas": 3}}, "archive": {"existingSecret": "s3-creds"}})
    image = one(objs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["image"]
    sched = one(objs, "Deployment", "-dask-scheduler")["spec"]["template"]["spec"]["containers"][0]
    worker_dep = one(objs, "Deployment", "-dask-worker")
    worker = worker_dep["spec"]["template"]["spec"]["containers"][0]
    assert sched["image"] == worker["image"] == image   # workers import gpulens.capture.analysis: the same code
    assert sched["command"] == ["dask", "scheduler"] and worker["command"] == ["dask", "worker"]
    assert worker["args"][0] == SCHEDULER
    assert "--nthreads=1" in worker["args"] and "--nworkers=1" in worker["args"]
    assert worker_dep["spec"]["replicas"] == 3
    env = {e["name"]: e.get("value") for e in sched["env"]}
    assert env["DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES"] == str(RETRIES)
    # the workers fetch traces and write summaries: the archive's credentials, not the scheduler's
    assert worker["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "envFrom" not in sched
    assert worker["resources"]["limits"]["memory"]     # the memory limit Dask sizes each worker from


def test_file_archive_workers_mount_the_host_folder_like_the_analysis_job():
    objs = render({"dask": {"enabled": True}, "archive": {"root": "file:///var/lib/gl-archive"}})
    spec = one(objs, "Deployment", "-dask-worker")["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = [(m["mountPath"], (vols[m["name"]].get("hostPath") or {}).get("path"))
              for m in spec["containers"][0]["volumeMounts"]]
    assert ("/var/lib/gl-archive", "/var/lib/gl-archive") in mounts
    assert spec["securityContext"]["runAsUser"] == 0
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    s3 = one(render({"dask": {"enabled": True}}), "Deployment", "-dask-worker")["spec"]["template"]["spec"]
    assert s3["securityContext"]["runAsNonRoot"] is True
    assert not [v for v in s3["volumes"] if "hostPath" in v]


def _selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


def test_network_policy_admits_analysis_pods_and_the_cluster_only():
    """Dask's protocol is unauthenticated: the policy covers both Deployments and admits the
    analysis Job's pod (as the coordinator builds it), the scheduler and workers, nothing else."""
    values = {"dask": {"enabled": True}}
    objs = render(values)
    (policy,) = by_kind(_dask(objs), "NetworkPolicy")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in by_kind(_dask(objs), "Deployment")}
    assert all(_selects(policy["spec"]["podSelector"], labels) for labels in pods.values()), pods
    (rule,) = policy["spec"]["ingress"]
    analysis = _job(values)["spec"]["template"]["metadata"]["labels"]

    def admitted(labels: dict) -> bool:
        return any(_selects(peer["podSelector"], labels) for peer in rule["from"])
    assert admitted(analysis)
    assert all(admitted(labels) for labels in pods.values())
    trainer = {"app.kubernetes.io/component": "trainer", "gpulens.dev/job": "llama"}
    other_release = dict(next(iter(pods.values())), **{"app.kubernetes.io/instance": "other"})
    assert not admitted(trainer) and not admitted(other_release)
    assert not by_kind(_dask(render({"dask": {"enabled": True, "networkPolicy": {"enabled": False}}})), "NetworkPolicy")


@pytest.mark.parametrize("bad", [{"workers": {"replicas": 0}}, {"port": 0}, {"enabled": "yes"}, {"operator": True},
                                 {"existingScheduler": "analysis-scheduler:8786"},
                                 {"existingScheduler": "http://analysis-scheduler:8786"},
                                 {"existingScheduler": "tcp://analysis-scheduler"}])
def test_bad_dask_values_are_refused_by_the_schema(bad):
    with pytest.raises(HelmValuesError) as err:
        render({"dask": bad})
    assert "/dask" in str(err.value)
