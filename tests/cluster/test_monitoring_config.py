"""Offline tests of the cluster room's monitoring pieces (no cluster, no root): the Prometheus and
Alertmanager configs of cluster/monitoring.py checked by the real promtool/amtool, and the pod
discovery bridge cluster/pod_sd.py (its labels, and its answers to bad input and a failing API).
Not marked `cluster`: they run everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.alertrules.conftest import AMTOOL, PROMTOOL, need, run

from .harness import REPO

sys.path.insert(0, str(REPO / "cluster"))
import monitoring  # noqa: E402
import pod_sd  # noqa: E402


def _monitoring(tmp_path, **kw) -> monitoring.Monitoring:
    (tmp_path / "sa-token").write_text("sa-token\n")
    (tmp_path / "gateway-token").write_text("gw-token\n")
    (tmp_path / "ca.crt").write_text("not checked by promtool\n")
    rules = monitoring.write_rules(tmp_path / "rules")
    return monitoring.Monitoring(token_file=tmp_path / "sa-token", ca_file=tmp_path / "ca.crt",
                                 gateway_url="http://10.96.7.7:9453", gateway_token_file=tmp_path / "gateway-token",
                                 alertmanager="127.0.0.1:9093", rule_files=rules, **kw)


def test_prometheus_config_with_the_pod_sd_bridge_passes_promtool(tmp_path):
    m = _monitoring(tmp_path, pod_sd_url="http://127.0.0.1:9095")
    prom, _ = monitoring.write_configs(tmp_path, m)
    r = run(need(PROMTOOL), "check", "config", str(prom))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(m.rule_files)} rule files found" in r.stdout, r.stdout


def test_both_discovery_forms_share_the_relabelling_and_only_the_sd_block_differs(tmp_path):
    """The README's form (kubernetes_sd_configs) cannot be checked by Debian's promtool, which has
    no Kubernetes discovery; it differs from the checked one only in its SD block."""
    user = monitoring.scrape_configs(_monitoring(tmp_path))
    here = monitoring.scrape_configs(_monitoring(tmp_path, pod_sd_url="http://127.0.0.1:9095"))
    assert [j["job_name"] for j in user] == ["gpulens-exporter", "gpulens-agent"]
    for u, h in zip(user, here):
        assert {k: v for k, v in u.items() if k != "kubernetes_sd_configs"} == \
               {k: v for k, v in h.items() if k != "http_sd_configs"}
        (sd,) = u["kubernetes_sd_configs"]
        assert sd["role"] == "pod" and sd["api_server"] == "https://10.244.0.1:6443"
        assert sd["namespaces"] == {"names": ["gpulens-system"]}
        assert sd["authorization"]["credentials_file"].endswith("sa-token")
        assert h["http_sd_configs"] == [{"url": "http://127.0.0.1:9095/v1/pods?namespace=gpulens-system",
                                         "refresh_interval": "5s"}]
    exporter = user[0]
    assert exporter["honor_labels"] is True        # the trainer's namespace/pod win over the target's


def test_rules_are_time_scaled_like_gpulens_up(tmp_path):
    m = _monitoring(tmp_path)
    groups = [g for p in m.rule_files for g in yaml.safe_load(p.read_text())["groups"]]
    rules = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert rules["GPUWorkloadHostSync"]["for"] == "10s"            # 5m / 30
    assert "[10s]" in next(r["expr"] for g in groups for r in g["rules"]
                           if r.get("record") == "namespace_pod:gpulens_kernel_launches:rate5m")
    r = run(need(PROMTOOL), "check", "rules", *map(str, m.rule_files))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_config_sends_auto_capture_alerts_to_the_gateway_service_with_its_token(tmp_path):
    m = _monitoring(tmp_path)
    _, am = monitoring.write_configs(tmp_path, m)
    amtool = need(AMTOOL)
    r = run(amtool, "check-config", str(am))
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = yaml.safe_load(am.read_text())
    (hook,) = next(x for x in cfg["receivers"] if x["name"] == "gpulens-gateway")["webhook_configs"]
    assert hook["url"] == "http://10.96.7.7:9453/v1/alertmanager"
    assert hook["http_config"]["authorization"]["credentials_file"] == str(tmp_path / "gateway-token")
    routed = lambda *labels: run(amtool, "config", "routes", "test", f"--config.file={am}", *labels).stdout.strip()  # noqa: E731
    assert routed("alertname=GPUWorkloadHostSync", "gpulens_capture=auto", "namespace=ml") == "gpulens-gateway"
    assert routed("alertname=GPUWorkloadStalled", "gpulens_capture=hang", "namespace=ml") == "gpulens-gateway"
    assert routed("alertname=GPULensAgentDown", "gpulens_capture=none", "namespace=ml") == "null"
    assert routed("alertname=GPULensAgentDown", "namespace=ml") == "null"


def test_rbac_grants_only_reading_pods():
    docs = monitoring.rbac()
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    assert docs[2]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert docs[3]["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus", "namespace": "gpulens-monitoring"}]


def test_cli_writes_configs_that_promtool_accepts(tmp_path):
    (tmp_path / "t").write_text("x")
    r = run(sys.executable, str(REPO / "cluster" / "monitoring.py"), "config", "--out", str(tmp_path / "o"),
            "--token-file", str(tmp_path / "t"), "--ca-file", str(tmp_path / "t"), "--gateway-url", "http://10.96.0.9:9453",
            "--gateway-token-file", str(tmp_path / "t"), "--alertmanager", "127.0.0.1:1",
            "--pod-sd-url", "http://127.0.0.1:2")
    assert r.returncode == 0, r.stderr
    c = run(need(PROMTOOL), "check", "config", str(tmp_path / "o" / "prometheus.yml"))
    assert c.returncode == 0, c.stdout + c.stderr
    assert run(sys.executable, str(REPO / "cluster" / "monitoring.py"), "config").returncode == 2


# --- the pod discovery bridge ---------------------------------------------------------------

NODE_POD = {
    "metadata": {"namespace": "gpulens-system", "name": "gl-gpulens-node-x7", "uid": "u-1",
                 "labels": {"app.kubernetes.io/name": "gpulens", "app.kubernetes.io/component": "node"},
                 "annotations": {"kubectl.kubernetes.io/default-container": "agent"},
                 "ownerReferences": [{"kind": "DaemonSet", "name": "gl-gpulens-node", "controller": True}]},
    "spec": {"nodeName": "gpulens-node",
             "initContainers": [{"name": "prepare-dirs", "image": "img:1"}],
             "containers": [{"name": "exporter", "image": "img:1", "ports": [{"name": "metrics", "containerPort": 9450, "protocol": "TCP"}]},
                            {"name": "agent", "image": "img:1", "ports": [{"name": "agent", "containerPort": 9451}]}]},
    "status": {"podIP": "10.244.0.1", "hostIP": "10.244.0.1", "phase": "Running",
               "conditions": [{"type": "Ready", "status": "True"}]},
}


def test_targets_carry_the_upstream_pod_role_labels():
    groups = pod_sd.target_groups({"items": [NODE_POD, {**NODE_POD, "status": {"phase": "Pending"}}]})
    assert [g["targets"] for g in groups] == [["10.244.0.1:9450"], ["10.244.0.1:9451"], ["10.244.0.1"]]
    exporter = groups[0]["labels"]
    assert exporter["__meta_kubernetes_namespace"] == "gpulens-system"
    assert exporter["__meta_kubernetes_pod_name"] == "gl-gpulens-node-x7"
    assert exporter["__meta_kubernetes_pod_label_app_kubernetes_io_component"] == "node"
    assert exporter["__meta_kubernetes_pod_labelpresent_app_kubernetes_io_name"] == "true"
    assert exporter["__meta_kubernetes_pod_annotation_kubectl_kubernetes_io_default_container"] == "agent"
    assert exporter["__meta_kubernetes_pod_container_port_name"] == "metrics"
    assert exporter["__meta_kubernetes_pod_container_port_number"] == "9450"
    assert exporter["__meta_kubernetes_pod_node_name"] == "gpulens-node"
    assert exporter["__meta_kubernetes_pod_ready"] == "true"
    assert exporter["__meta_kubernetes_pod_controller_kind"] == "DaemonSet"
    assert exporter["__meta_kubernetes_pod_container_init"] == "false"
    assert groups[1]["labels"]["__meta_kubernetes_pod_container_port_protocol"] == "TCP"   # the API's default
    init = groups[2]["labels"]
    assert init["__meta_kubernetes_pod_container_init"] == "true" and "__meta_kubernetes_pod_container_port_name" not in init


def _api_double(status: int, seen: list):
    """Stands for the API server's GET /api/v1/namespaces/{ns}/pods (plain HTTP, same JSON)."""
    async def pods(request: web.Request) -> web.Response:
        seen.append((request.match_info["ns"], request.headers.get("Authorization")))
        if status != 200:
            return web.json_response({"kind": "Status", "code": status, "reason": "Forbidden"}, status=status)
        return web.json_response({"kind": "PodList", "items": [NODE_POD]})
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods", pods)
    return app


async def _bridge(tmp_path, api_url: str):
    (tmp_path / "token").write_text("sa-token\n")
    ca = Path("/etc/ssl/certs/ca-certificates.crt")      # any CA file: the double speaks plain HTTP
    return TestClient(TestServer(pod_sd.make_app(pod_sd.ApiSource(api_url, tmp_path / "token", ca))))


async def test_bridge_lists_pods_as_the_service_account(tmp_path):
    seen: list = []
    async with TestServer(_api_double(200, seen)) as api:
        async with await _bridge(tmp_path, str(api.make_url("")).rstrip("/")) as client:
            r = await client.get("/v1/pods", params={"namespace": "gpulens-system"})
            assert r.status == 200
            assert [g["targets"] for g in await r.json()][:2] == [["10.244.0.1:9450"], ["10.244.0.1:9451"]]
    assert seen == [("gpulens-system", "Bearer sa-token")]


@pytest.mark.parametrize("query", [{}, {"namespace": ""}, {"namespace": "Bad_NS"}, {"namespace": "a/../b"}])
async def test_bridge_refuses_a_bad_namespace_without_calling_the_api(tmp_path, query):
    seen: list = []
    async with TestServer(_api_double(200, seen)) as api:
        async with await _bridge(tmp_path, str(api.make_url("")).rstrip("/")) as client:
            r = await client.get("/v1/pods", params=query)
            assert r.status == 400 and (await r.json())["field"] == "namespace"
    assert seen == []


async def test_bridge_answers_502_when_the_api_refuses_or_is_down(tmp_path):
    seen: list = []
    async with TestServer(_api_double(403, seen)) as api:
        url = str(api.make_url("")).rstrip("/")
        async with await _bridge(tmp_path, url) as client:
            r = await client.get("/v1/pods", params={"namespace": "gpulens-system"})
            assert r.status == 502 and "403" in (await r.json())["error"]
    async with await _bridge(tmp_path, url) as client:        # the API server is gone now
        r = await client.get("/v1/pods", params={"namespace": "gpulens-system"})
        assert r.status == 502


def test_the_readme_shows_the_configs_the_module_renders():
    text = (REPO / "README.md").read_text()
    for name, rendered in monitoring.readme_blocks().items():
        marker = f"<!-- gpulens-monitoring:{name} -->\n```yaml\n"
        assert marker in text, f"README lacks the {name} block"
        block = text.split(marker, 1)[1].split("```", 1)[0]
        assert block == rendered, f"README's {name} block is stale: `python cluster/monitoring.py readme` prints it"
    # and the README's form is the user's: API discovery, not the tests' HTTP SD bridge
    assert "kubernetes_sd_configs" in monitoring.readme_blocks()["scrape"]


def test_readme_cli_prints_the_blocks():
    r = run(sys.executable, str(REPO / "cluster" / "monitoring.py"), "readme")
    assert r.returncode == 0 and all(b in r.stdout for b in monitoring.readme_blocks().values())
