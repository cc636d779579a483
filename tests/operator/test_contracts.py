"""What the operator and the chart hand to other components is what those components accept:
objects valid for their kinds, command lines within docs/ARCHITECTURE.md's "Command-line
contract" (and, where a component is built, accepted by its own argument parser), and an
operator config the operator loads."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.config import OperatorConfigError, OperatorConfig
from gpulens.capture.operator.jobs import job_of_pod
from gpulens.capture.operator.manifests import (coordinator_args, coordinator_pod, coordinator_resource, coordinator_role_binding,
                                        coordinator_service, coordinator_service_account, copied_secret)
from gpulens.cli import build_subparser

from ..helm.chart import REPO, containers, one, render, validate
from ..helm.value_sets import VALUE_SETS
from .conftest import operator_config


def _contract_flags() -> dict[str, set[str]]:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Command-line contract", 1)[1].split("```", 2)[1]
    flags: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"gpulens (\w[\w-]*)", line)
        if m:
            current = m.group(1)
        if current:
            flags.setdefault(current, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line))
    return flags


def _flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def _sample_cc(config=None, **pod_over):
    config = config or operator_config()
    pod = {"metadata": {"name": "llama-0", "namespace": "ml",
                        "labels": {L.ARMED: "true", L.JOB: "llama", L.ATTEMPT: "2"},
                        "annotations": {L.LOCAL_WORLD_SIZE: "8", L.WORLD_SIZE: "32"},
                        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "llama", "uid": "u1"}]}}
    pod["metadata"].update(pod_over)
    cc = coordinator_resource(job_of_pod(pod), 2, [pod], config)
    cc["metadata"]["uid"] = "cc-uid"
    return cc


def test_everything_the_operator_creates_is_valid():
    config = operator_config(coordinator={"archive_root": "s3://b/p", "grafana_url": "https://g.example.com",
                                          "archive_secret": "s3", "capture_defaults": {"duration_ms": 3000},
                                          "tolerations": [{"key": "k", "operator": "Exists"}],
                                          "node_selector": {"pool": "infra"}})
    cc = _sample_cc(config)
    assert validate(cc) == "crd-schema"
    assert cc["spec"]["worldSize"] == 32 and cc["spec"]["localWorldSize"] == 8
    assert cc["spec"]["captureDefaults"] == {"durationMs": 3000}
    for body in (coordinator_pod(cc, config), coordinator_service(cc, config), coordinator_service_account(cc, config),
                 coordinator_role_binding(cc, config), copied_secret(cc, "tokens", {"agent": "YQ=="})):
        for version in ("1.27", "1.36"):
            kubernetes_validate.validate(body, version, strict=True)


def test_coordinator_command_line_is_within_the_contract():
    cc = _sample_cc(operator_config(coordinator={"archive_root": "s3://b/p", "grafana_url": "https://g",
                                                 "s3_endpoint": "http://minio:9000"}))
    args = coordinator_args(cc, operator_config())
    assert args[:2] == ["gpulens", "coordinator"]
    assert _flags(args) <= _contract_flags()["coordinator"]
    assert args[args.index("--selector") + 1] == "gpulens.dev/armed=true,gpulens.dev/attempt=2,gpulens.dev/job=llama"
    assert args[args.index("--discovery") + 1] == "kubernetes"
    assert args[args.index("--agent-url-template") + 1] == "http://{node_ip}:9451"


def _parser_or_skip(name: str):
    parser, _ = build_subparser(name)
    known = {a for action in parser._actions for a in action.option_strings}
    assert not known <= {"-h", "--help", "--log-level"}, f"`gpulens {name}` has no options of its own"
    return parser


def test_the_coordinator_accepts_what_the_operator_passes():
    parser = _parser_or_skip("coordinator")
    parser.parse_args(coordinator_args(_sample_cc(), operator_config())[2:])


@pytest.mark.parametrize("component,workload,container", [
    ("exporter", "-node", "exporter"), ("agent", "-node", "agent"), ("gateway", "-gateway", "gateway"),
    ("operator", "-operator", "operator")])
def test_chart_command_lines_are_within_the_contract_and_parse(component, workload, container):
    objs = render(VALUE_SETS["everything"])
    kind = "DaemonSet" if workload == "-node" else "Deployment"
    c = containers(one(objs, kind, workload))[container]
    assert c["command"] == ["gpulens"] and c["args"][0] == component
    args = [a.replace("$(GPULENS_NODE_NAME)", "gpu-node-1") for a in c["args"][1:]]
    if component != "operator":
        extras = {"--log-level"}
        assert _flags(args) - extras <= _contract_flags()[component], component
    parser = _parser_or_skip(component)
    parser.parse_args(args)


@pytest.mark.parametrize("set_name", sorted(VALUE_SETS))
def test_the_chart_operator_config_loads(set_name):
    objs = render(VALUE_SETS[set_name])
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-operator")]
    if not cms:
        assert VALUE_SETS[set_name].get("operator", {}).get("enabled") is False
        return
    cfg = OperatorConfig.from_dict(yaml.safe_load(cms[0]["data"]["operator.yaml"]))
    values = {**{"archive": {"root": "s3://gpulens/captures"}}, **VALUE_SETS[set_name]}
    assert cfg.coordinator.archive_root == values["archive"]["root"]
    assert cfg.arming.socket_dir == values.get("node", {}).get("paths", {}).get("sockets", "/run/gpulens")
    # The arming config uses the same host folders as the DaemonSet mounts for the agent.
    agent = containers(one(objs, "DaemonSet", "-node"))["agent"]
    mounted = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {cfg.arming.registry_dir, cfg.arming.trace_dir, cfg.arming.socket_dir} <= mounted


@pytest.mark.parametrize("change,where", [
    ({"image": ""}, "image"),
    ({"coordinator": {"archive_root": "bucket"}}, "coordinator/archive_root"),
    ({"arming": {"socket_dir": "/run/" + "x" * 60}}, "arming/socket_dir"),
    ({"leader_election": {"lease_name": "x", "surprise": 1}}, "leader_election"),
])
def test_a_bad_operator_config_names_the_field(change, where):
    data = {"namespace": "ns", "image": "i", "tokens_secret": "t", "coordinator": {"archive_root": "s3://b/p"}}
    data.update(change)
    with pytest.raises(OperatorConfigError) as err:
        OperatorConfig.from_dict(data)
    assert where in str(err.value)


def test_names_are_valid_and_distinct_for_awkward_job_ids():
    ids = ["llama", "Llama", "llama_v2", "a" * 63, "a" * 62 + "b", "7b-run", "x.y"]
    names = {L.coordinator_name(i, 0) for i in ids}
    assert len(names) == len(ids)
    for n in names | {L.service_name(i) for i in ids}:
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63, n
    assert L.coordinator_name("llama", 0) == "gpulens-llama-a0" and L.service_name("llama") == "gpulens-llama"


@pytest.mark.parametrize("job_id", ["llama", "Llama_V2", "x" * 70, "7b.run"])
def test_the_gateway_finds_the_service_the_operator_creates(job_id):
    from gpulens.capture.gateway.routing import Router
    objs = render()
    args = containers(one(objs, "Deployment", "-gateway"))["gateway"]["args"]
    template = next(a.split("=", 1)[1] for a in args if a.startswith("--coordinator-url-template="))
    cc = _sample_cc()
    cc["spec"]["jobId"] = job_id
    cc["metadata"]["namespace"] = "ml"
    config = operator_config()
    from gpulens.capture.operator.manifests import endpoint_of
    assert Router(template=template).resolve("ml", job_id).url == endpoint_of(cc, config)
    assert coordinator_service(cc, config)["metadata"]["name"] in endpoint_of(cc, config)


def test_the_chart_default_runs_the_analysis_as_a_job_with_its_resources():
    objs = render({})
    cfg = OperatorConfig.from_dict(yaml.safe_load(one(objs, "ConfigMap", "-operator")["data"]["operator.yaml"]))
    assert cfg.coordinator.analysis == "job"
    assert cfg.coordinator.analysis_resources == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                                  "limits": {"memory": "8Gi"}}
    assert (cfg.coordinator.analysis_timeout_s, cfg.coordinator.analysis_ttl_s) == (1800, 3600)
    local = render({"coordinator": {"analysis": "local"}})
    assert "analysis: local" in one(local, "ConfigMap", "-operator")["data"]["operator.yaml"]


def test_the_analysis_job_the_operator_asks_for_is_valid_owned_and_outside_the_job_service():
    """What `--analysis job` flags the operator passes become, through the coordinator's own parser,
    a Job owned by the CaptureCoordinator, as its ServiceAccount, with its archive Secret."""
    from gpulens.capture.coordinator.analysis_job import analysis_job
    from gpulens.capture.coordinator.command import analysis_for
    from gpulens.capture.operator.manifests import children_of

    config = operator_config(coordinator={"archive_root": "s3://b/p", "s3_endpoint": "http://minio:9000",
                                          "archive_secret": "s3", "cluster_role": "gl-gpulens-coordinator",
                                          "analysis_resources": {"limits": {"memory": "8Gi"}},
                                          "analysis_timeout_s": 900},
                             image_pull_secrets=["regcred"])
    cc = _sample_cc(config)
    args = coordinator_args(cc, config)
    assert args[args.index("--analysis") + 1] == "job"
    assert _flags(args) <= _contract_flags()["coordinator"]
    parser = _parser_or_skip("coordinator")
    runner = analysis_for(parser.parse_args(args[2:]), api_client=object())
    job = analysis_job(runner.spec, "s3://b/p/ml/llama/2/c-1/manifest.json", "c-1")
    for version in ("1.27", "1.36"):
        kubernetes_validate.validate(job, version, strict=True)
    names = children_of(cc)
    pod = job["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert job["metadata"]["namespace"] == "ml" and job["spec"]["activeDeadlineSeconds"] == 960
    assert job["metadata"]["ownerReferences"][0]["uid"] == "cc-uid"
    assert job["metadata"]["ownerReferences"][0]["name"] == cc["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == names["sa"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["image"] == config.image and c["envFrom"] == [{"secretRef": {"name": names["archive"]}}]
    assert c["args"][-2:] == ["--s3-endpoint", "http://minio:9000"]
    assert c["resources"] == {"limits": {"memory": "8Gi"}}
    labels = pod["metadata"]["labels"]
    assert labels[L.JOB] == "llama" and labels[L.ATTEMPT] == "2" and labels[L.MANAGED_BY] == L.MANAGER
    assert labels[L.ARMED] == "false" and labels[L.COMPONENT] == "analysis"
    # the job's Service selects gpulens.dev/coordinator=<cc>: the analysis pod must never be its endpoint
    service = coordinator_service(cc, config)
    assert not set(service["spec"]["selector"].items()) <= set(labels.items())
    # ... and the arming webhook leaves it alone, as it does the coordinator's own Pod
    from gpulens.capture.operator.arming import armed_pod
    assert armed_pod({"metadata": pod["metadata"], "spec": pod["spec"]}, "ml", config.arming, config.image)[0] is None


def test_analysis_local_or_none_passes_no_job_flags():
    for mode in ("local", "none"):
        config = operator_config(coordinator={"archive_root": "s3://b/p", "analysis": mode})
        args = coordinator_args(_sample_cc(config), config)
        assert args[args.index("--analysis") + 1] == mode
        assert not [a for a in args if a.startswith(("--analysis-", "--coordinator-"))]


def test_a_serving_revisions_coordinator_command_line_parses_and_is_within_the_contract():
    pod = {"metadata": {"name": "web-7f9c8d5b4-x2x9z", "namespace": "serve",
                        "labels": {L.ARMED: "true", L.JOB: "web-7f9c8d5b4", L.ATTEMPT: "0", L.SERVING: "Deployment"}}}
    cc = coordinator_resource(job_of_pod(pod), 0, [pod], operator_config())
    cc["metadata"]["uid"] = "cc-uid"
    assert validate(cc) == "crd-schema"
    args = coordinator_args(cc, operator_config())
    assert "--serving" in args and _flags(args) <= _contract_flags()["coordinator"]
    assert build_subparser("coordinator")[0].parse_args(args[2:]).serving is True


def test_the_charts_capture_values_reach_every_coordinators_arguments():
    """Issue 43: --budget-mb, --start-lead-s and --wall-start-lead-s were never passed, so a platform
    team could not set them. Someone else's values, through the chart's ConfigMap and the operator's
    config, become the coordinator's flags, read back by the coordinator's own parser."""
    from gpulens.capture.coordinator.command import _check as coordinator_check
    values = {"coordinator": {"capture": {"budgetMB": 48, "startLeadSeconds": 30, "wallStartLeadSeconds": 25.5}}}
    cfg = OperatorConfig.from_dict(yaml.safe_load(one(render(values), "ConfigMap", "-operator")["data"]["operator.yaml"]))
    args = coordinator_args(_sample_cc(cfg), cfg)
    parsed = _parser_or_skip("coordinator").parse_args(args[2:])
    assert (parsed.budget_mb, parsed.start_lead_s, parsed.wall_start_lead_s) == (48, 30.0, 25.5)
    assert coordinator_check(parsed) is None
    # the chart's defaults are the coordinator's own defaults, not a second opinion
    default_cfg = OperatorConfig.from_dict(yaml.safe_load(one(render({}), "ConfigMap", "-operator")["data"]["operator.yaml"]))
    parser, d = _parser_or_skip("coordinator"), default_cfg.coordinator
    assert (d.budget_mb, d.start_lead_s, d.wall_start_lead_s) == tuple(
        parser.get_default(k) for k in ("budget_mb", "start_lead_s", "wall_start_lead_s"))
    # out of range is refused by the chart's schema before anything is rendered
    with pytest.raises(Exception, match="wallStartLeadSeconds|minimum"):
        render({"coordinator": {"capture": {"wallStartLeadSeconds": 5}}})
