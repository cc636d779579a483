"""`gpulens operator` as a process: real kopf, real kubernetes client, Lease election between two
replicas, the TLS webhook, and clean shutdown on SIGTERM, against the test API server."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from .conftest import OPERATOR_NS
from .test_arming import job_pod
from .test_serving_arming import deployment_pod
from .test_kopf_operator import _wait
from .test_webhook import review
from .tls import make_certs

pytestmark = pytest.mark.slow

LEASE = "gpulens-operator"


def _files(tmp_path: Path, apiserver, **config_over) -> tuple[Path, Path]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": apiserver.url}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    config = {"namespace": OPERATOR_NS, "image": "registry.example.com/gpulens:0.1.0",
              "tokens_secret": "gl-gpulens-tokens", "resync_interval_s": 1,
              "leader_election": {"lease_name": LEASE, "lease_duration_s": 4, "renew_period_s": 0.3},
              "coordinator": {"archive_root": "s3://traces/gpulens"}}
    config.update(config_over)
    path = tmp_path / "operator.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, kubeconfig


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.p = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                return self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        return self.p.returncode

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def _holder(cluster) -> str:
    from kubernetes import client
    try:
        lease = json.loads(client.CoordinationV1Api(cluster.api.api_client())
                           .read_namespaced_lease(LEASE, OPERATOR_NS, _preload_content=False).data)
    except client.ApiException:
        return ""
    return lease["spec"].get("holderIdentity") or ""


def test_once_prints_and_applies_the_plan(tmp_path, apiserver, cluster, gpulens_bin):
    cfg, kc = _files(tmp_path, apiserver)
    cluster.tokens()
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    done = subprocess.run([gpulens_bin, "operator", "--config", str(cfg), "--kubeconfig", str(kc), "--once"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    assert "ml/llama: keep=gpulens-llama-a0 create=yes delete=-" in done.stdout
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a0"]


def test_a_bad_config_is_one_clear_line_and_exit_2(tmp_path, apiserver, gpulens_bin):
    cfg, kc = _files(tmp_path, apiserver, coordinator={"archive_root": "my-bucket"})
    done = subprocess.run([gpulens_bin, "operator", "--config", str(cfg), "--kubeconfig", str(kc)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 2
    assert "event=operator.failed" in done.stderr and "coordinator/archive_root" in done.stderr
    assert "Traceback" not in done.stderr


def test_two_replicas_one_leader_failover_and_webhook(tmp_path, apiserver, cluster, gpulens_bin, procs):
    from .conftest import free_port_pair

    cfg, kc = _files(tmp_path, apiserver)
    ca, cert, key = make_certs(tmp_path)
    cluster.tokens()
    ports = free_port_pair()
    for identity, port in zip(("op-1", "op-2"), ports):
        procs.append(Proc([gpulens_bin, "operator", "--config", str(cfg), "--kubeconfig", str(kc),
                           "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
                           "--identity", identity], tmp_path / f"{identity}.log"))
        if identity == "op-1":
            _wait(lambda: _holder(cluster) == "op-1", "op-1 to lead")
    # Both serve the webhook, leader or not.
    ctx = ssl.create_default_context(cafile=str(ca))
    for port in ports:
        def mutate(port=port):
            req = urllib.request.Request(f"https://127.0.0.1:{port}/mutate", data=json.dumps(review(job_pod())).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                return json.loads(urllib.request.urlopen(req, context=ctx, timeout=10).read())
            except OSError:
                return None
        body = _wait(mutate, f"the webhook on {port}")
        assert body["response"]["allowed"] is True and body["response"]["patchType"] == "JSONPatch"
    # The serving entry arms an opted-in Deployment pod, but never in kube-system or the operator's
    # own namespace (the config's): on Kubernetes 1.20 the chart's namespaceSelector cannot exclude them.
    armed_in = []
    for ns in ("serve", "kube-system", OPERATOR_NS):
        r = review(deployment_pod(labels={"gpulens.dev/arm": "true"}))
        r["request"]["namespace"] = r["request"]["object"]["metadata"]["namespace"] = ns
        req = urllib.request.Request(f"https://127.0.0.1:{ports[0]}/mutate-serving", data=json.dumps(r).encode(),
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, context=ctx, timeout=10).read())["response"]
        assert answer["allowed"] is True
        if "patch" in answer:
            armed_in.append(ns)
    assert armed_in == ["serve"]

    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the leader to create the coordinator")
    assert _holder(cluster) == "op-1"
    assert "lease.following" in procs[1].text() and "coordinator.created" not in procs[1].text()

    assert procs[0].stop() == 0, procs[0].text()[-3000:]       # SIGTERM: releases the Lease
    assert "lease.released" in procs[0].text()
    _wait(lambda: _holder(cluster) == "op-2", "op-2 to take over")
    other = cluster.job("ml", "mistral")
    cluster.pod("ml", "mistral-0", job=other)
    _wait(lambda: "gpulens-mistral-a0" in cluster.names("Pod", "ml"), "the new leader to reconcile")
    assert "gpulens-llama-a0" in cluster.names("Pod", "ml")      # the failover touched nothing running
    assert procs[1].stop() == 0, procs[1].text()[-3000:]
    for p in procs:
        assert "Traceback" not in p.text(), p.text()[-3000:]
