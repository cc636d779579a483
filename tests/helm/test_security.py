"""Least privilege in what the chart renders: capabilities, host access, RBAC, network policy,
and the webhook's opt-in scope and TLS."""

from __future__ import annotations

import base64

import pytest

from .chart import by_kind, containers, one, render
from .value_sets import VALUE_SETS


def _pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def _caps(container):
    return set(container.get("securityContext", {}).get("capabilities", {}).get("add", []))


def test_exporter_gets_bpf_perfmon_ptrace_and_nothing_else_by_default():
    ds = one(render(), "DaemonSet", "-node")
    c = containers(ds)
    assert _caps(c["exporter"]) == {"BPF", "PERFMON", "SYS_PTRACE"}
    assert c["exporter"]["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert _caps(c["agent"]) == {"DAC_READ_SEARCH", "SYS_PTRACE"}
    assert _caps(c["prepare-dirs"]) == set()


def test_sys_admin_only_when_asked_for():
    c = containers(one(render({"exporter": {"sysAdmin": True}, "agent": {"extraCapabilities": ["FOWNER"]}}),
                       "DaemonSet", "-node"))
    assert _caps(c["exporter"]) == {"BPF", "PERFMON", "SYS_PTRACE", "SYS_ADMIN"}
    assert _caps(c["agent"]) == {"DAC_READ_SEARCH", "SYS_PTRACE", "FOWNER"}


@pytest.mark.parametrize("set_name", sorted(VALUE_SETS))
def test_nothing_is_privileged_or_escalates(set_name):
    for obj in render(VALUE_SETS[set_name]):
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        for name, c in containers(obj).items():
            sc = c.get("securityContext", {})
            assert sc.get("privileged", False) is False, (obj["metadata"]["name"], name)
            assert sc.get("allowPrivilegeEscalation") is False, (obj["metadata"]["name"], name)
            assert sc.get("readOnlyRootFilesystem") is True, (obj["metadata"]["name"], name)
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], (obj["metadata"]["name"], name)


def test_only_the_node_daemonset_touches_the_host():
    objs = render(VALUE_SETS["everything"])
    for obj in by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment"):
        spec = _pod_spec(obj)
        node = obj["metadata"]["name"].endswith("-node")
        assert spec.get("hostPID", False) is node, obj["metadata"]["name"]
        assert spec.get("hostNetwork", False) is node, obj["metadata"]["name"]   # dynolog: never
        host_paths = [v for v in spec.get("volumes", []) if "hostPath" in v]
        if obj["metadata"]["name"].endswith("-dynolog"):
            assert [v["hostPath"]["path"] for v in host_paths] == ["/run/gpulens"]
        elif not node:
            assert host_paths == [], obj["metadata"]["name"]


def test_unprivileged_components_run_as_non_root():
    objs = render()
    for suffix in ("-operator", "-gateway"):
        spec = _pod_spec(one(objs, "Deployment", suffix))
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert _pod_spec(one(objs, "Deployment", "-gateway"))["automountServiceAccountToken"] is False


def test_gpu_nodes_are_targeted_and_tolerated_by_default():
    spec = _pod_spec(one(render(), "DaemonSet", "-node"))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    spec = _pod_spec(one(render(VALUE_SETS["no-host-network"]), "DaemonSet", "-node"))
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert "hostNetwork" not in spec or spec["hostNetwork"] is False


def test_dynolog_port_is_closed_to_the_cluster_network():
    objs = render(VALUE_SETS["everything"])
    np = one(objs, "NetworkPolicy", "-dynolog")
    ds = one(objs, "DaemonSet", "-dynolog")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert set(np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert np["spec"]["ingress"] == [] and np["spec"]["egress"] == []
    svc = one(objs, "Service", "-dynolog")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    # The agent is pointed at that node-local Service, not at a host port.
    agent = containers(one(objs, "DaemonSet", "-node"))["agent"]
    assert f"--dynolog-addr={svc['metadata']['name']}.gpulens-system.svc:1778" in agent["args"]
    assert "hostPort" not in str(ds)


def _rules(objs, kind, suffix):
    return one(objs, kind, suffix)["rules"]


def test_rbac_has_no_wildcards_anywhere():
    for obj in render(VALUE_SETS["everything"]):
        for rule in obj.get("rules", []) if obj["kind"] in ("ClusterRole", "Role") else []:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), (obj["metadata"]["name"], rule)


def test_operator_rbac_is_least_privilege():
    objs = render(VALUE_SETS["everything"])
    cluster = _rules(objs, "ClusterRole", "-operator")
    granted = {(g, r, v) for rule in cluster for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    # Cluster-wide it may read pods and create coordinator objects, but never read Secrets,
    # never update or delete anything but CaptureCoordinators, and never touch trainer pods.
    assert ("", "secrets", "get") not in granted and ("", "secrets", "list") not in granted
    assert {v for g, r, v in granted if (g, r) != ("gpulens.dev", "capturecoordinators")} & {"update", "delete"} == set()
    assert ("", "pods", "patch") not in granted and ("", "pods", "delete") not in granted
    bind = next(rule for rule in cluster if "bind" in rule["verbs"])
    assert bind["resourceNames"] == ["gl-gpulens-coordinator"]
    role = _rules(objs, "Role", "-operator")
    secret_rule = next(rule for rule in role if rule["resources"] == ["secrets"])
    assert secret_rule["verbs"] == ["get"]
    assert set(secret_rule["resourceNames"]) == {"gpulens-tokens-sealed", "gpulens-s3"}
    # exactly: the discovery's pod reads and the analysis Job's create/get/delete (an extra verb,
    # e.g. jobs list or pods/log, fails here; tests/coordinator/test_analysis_job.py proves these suffice)
    assert _rules(objs, "ClusterRole", "-coordinator") == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "delete"]}]


def test_webhook_is_opt_in_per_namespace_and_never_blocks_pods():
    wh = one(render(), "MutatingWebhookConfiguration", "-operator")["webhooks"][0]
    assert wh["namespaceSelector"] == {"matchLabels": {"gpulens.dev/arming": "enabled"}}
    assert wh["objectSelector"]["matchExpressions"] == [{"key": "gpulens.dev/arm", "operator": "NotIn",
                                                         "values": ["false"]}]
    assert wh["failurePolicy"] == "Ignore" and wh["sideEffects"] == "None"
    assert wh["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                            "resources": ["pods"], "scope": "Namespaced"}]


def test_webhook_certificate_is_for_the_service_and_signed_by_the_advertised_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import padding

    objs = render()
    wh = one(objs, "MutatingWebhookConfiguration", "-operator")["webhooks"][0]
    secret = one(objs, "Secret", "-webhook-tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(wh["clientConfig"]["caBundle"]))
    assert base64.b64decode(secret["data"]["ca.crt"]) == base64.b64decode(wh["clientConfig"]["caBundle"])
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    svc = wh["clientConfig"]["service"]
    assert f"{svc['name']}.{svc['namespace']}.svc" in sans
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                           cert.signature_hash_algorithm)
    # The operator Service the API server calls really leads to the TLS port of the operator pods.
    service = one(objs, "Service", "-operator")
    assert service["metadata"]["name"] == svc["name"] and service["spec"]["ports"][0]["port"] == svc["port"]
    op = one(objs, "Deployment", "-operator")
    assert service["spec"]["selector"].items() <= op["spec"]["template"]["metadata"]["labels"].items()
    assert "--tls-cert=/etc/gpulens/tls/tls.crt" in containers(op)["operator"]["args"]


def test_cert_manager_mode_injects_the_ca_instead_of_generating_one():
    objs = render(VALUE_SETS["cert-manager"])
    cfg = one(objs, "MutatingWebhookConfiguration", "-operator")
    assert cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "gpulens-system/gl-gpulens-webhook-tls"
    assert "caBundle" not in cfg["webhooks"][0]["clientConfig"]
    cert = one(objs, "Certificate", "-webhook-tls")
    assert cert["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "selfsigned"}
    assert not [o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-webhook-tls")]


def test_node_servers_can_listen_on_the_node_ip_only():
    listens = lambda objs: {n: [a for a in c["args"] if a.startswith("--listen=")] for n, c in  # noqa: E731
                            containers(one(objs, "DaemonSet", "-node")).items() if n in ("exporter", "agent")}
    assert listens(render()) == {"exporter": ["--listen=0.0.0.0:9450"], "agent": ["--listen=0.0.0.0:9451"]}
    objs = render({"node": {"listenOnNodeIP": True}})
    assert listens(objs) == {"exporter": ["--listen=$(GPULENS_NODE_IP):9450"], "agent": ["--listen=$(GPULENS_NODE_IP):9451"]}
    for name, c in containers(one(objs, "DaemonSet", "-node")).items():
        if name in ("exporter", "agent"):
            env = {e["name"]: e for e in c["env"]}
            assert env["GPULENS_NODE_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}


def test_serving_workloads_are_armed_only_where_a_namespace_or_the_workload_opted_in():
    hooks = {w["name"]: w for w in one(render(), "MutatingWebhookConfiguration", "-operator")["webhooks"]}
    ns, workload = hooks["namespace.serving.arm.gpulens.dev"], hooks["workload.serving.arm.gpulens.dev"]
    assert ns["namespaceSelector"] == {"matchLabels": {"gpulens.dev/serving": "enabled"}}
    assert ns["objectSelector"]["matchExpressions"] == [{"key": "gpulens.dev/arm", "operator": "NotIn",
                                                         "values": ["false"]}]
    assert workload["objectSelector"] == {"matchLabels": {"gpulens.dev/arm": "true"}}
    assert "kube-system" in workload["namespaceSelector"]["matchExpressions"][0]["values"]
    for wh in (ns, workload):
        assert wh["clientConfig"]["service"]["path"] == "/mutate-serving"
        assert wh["failurePolicy"] == "Ignore" and wh["sideEffects"] == "None"
        assert wh["rules"] == hooks["arm.gpulens.dev"]["rules"]


def test_a_null_that_clears_the_gpu_selector_survives_helm_upgrade_reuse_values(tmp_path):
    """`helm upgrade --reuse-values` on a release installed with `nodeSelector: {gpu.present: null}`
    (the README's test-cluster values): Helm coalesces the new values with the old release's
    already-coalesced ones, which lack the key, so the null reaches the schema and the templates
    (the cluster test's upgrade failed "got null, want string"). Reproduced by rendering with the
    chart's defaults as Helm holds them then: the schema takes the null, the DaemonSets drop it."""
    import shutil

    import yaml
    from helm_python import chart as helm_chart

    from .chart import CHART_DIR
    chart = tmp_path / "gpulens"
    shutil.copytree(CHART_DIR, chart)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    values["node"]["nodeSelector"] = {}          # the old release's coalesced values: the key is gone
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    user = {"node": {"nodeSelector": {"nvidia.com/gpu.present": None, "pool": "gpu"}}, "dynolog": {"enabled": True, "image": {"repository": "example.com/dynolog"}}}
    texts = helm_chart.Chart.load(str(chart)).render(user, name="gl", namespace="gpulens-system")
    objs = [d for t in texts.values() for d in yaml.safe_load_all(t) if d]
    daemonsets = by_kind(objs, "DaemonSet")
    assert len(daemonsets) == 2, [d["metadata"]["name"] for d in daemonsets]    # node agent and dynolog
    for ds in daemonsets:
        assert _pod_spec(ds)["nodeSelector"] == {"pool": "gpu"}, ds["metadata"]["name"]


@pytest.mark.parametrize("namespace", ["gpulens-system", "inference-obs"])
def test_the_serving_workload_entrys_exclusions_hold_in_the_webhook_on_kubernetes_1_20(namespace):
    """The per-workload entry leaves kube-system and the release's namespace out by the label
    `kubernetes.io/metadata.name`, which the API server sets only from 1.21: on 1.20 (the chart's
    kubeVersion allows it) the selector matches every namespace. The operator this chart configures
    must skip exactly those namespaces itself (the rendered config's namespace, plus SERVING_NEVER)."""
    import json

    import yaml

    from gpulens.capture.operator.config import OperatorConfig
    from gpulens.capture.operator.webhook import SERVING_NEVER, review_response
    from tests.operator.test_serving_arming import deployment_pod
    from tests.operator.test_webhook import review

    objs = render(namespace=namespace)
    hooks = {w["name"]: w for w in one(objs, "MutatingWebhookConfiguration", "-operator")["webhooks"]}
    (expr,) = hooks["workload.serving.arm.gpulens.dev"]["namespaceSelector"]["matchExpressions"]
    assert (expr["key"], expr["operator"]) == ("kubernetes.io/metadata.name", "NotIn")
    config = OperatorConfig.from_dict(yaml.safe_load(one(objs, "ConfigMap", "-operator")["data"]["operator.yaml"]))
    never = frozenset(SERVING_NEVER + (config.namespace,))
    assert set(expr["values"]) == never == {"kube-system", namespace}

    def patched(ns: str) -> bool:
        r = review(deployment_pod(labels={"gpulens.dev/arm": "true"}))
        r["request"]["namespace"] = r["request"]["object"]["metadata"]["namespace"] = ns
        return "patch" in json.loads(json.dumps(review_response(r, config.arming, config.image, serving=True,
                                                                never=never)))["response"]
    assert [ns for ns in ("kube-system", namespace, "serve") if patched(ns)] == ["serve"]
