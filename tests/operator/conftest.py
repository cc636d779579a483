"""Fixtures for the operator tests: a test API server (tests/operator/apiserver.py) reached with
the real `kubernetes` client, and helpers that create jobs and pods the way their controllers do."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from kubernetes import client

from gpulens.capture.operator.config import OperatorConfig
from gpulens.capture.operator.kube import KubeApi
from gpulens.capture.operator.reconcile import Reconciler

from .apiserver import running_apiserver

OPERATOR_NS = "gpulens-system"


def operator_config(**over: Any) -> OperatorConfig:
    data = {"namespace": OPERATOR_NS, "image": "registry.example.com/gpulens:0.1.0",
            "tokens_secret": "gl-gpulens-tokens",
            "coordinator": {"archive_root": "s3://traces/gpulens", "cluster_role": "gl-gpulens-coordinator"}}
    data.update(over)
    return OperatorConfig.from_dict(data)


@pytest.fixture
def apiserver():
    with running_apiserver() as api:
        yield api


@pytest.fixture
def cluster(apiserver):
    return Cluster(apiserver)


@pytest.fixture
def config() -> OperatorConfig:
    return operator_config()


@pytest.fixture
def reconciler(cluster, config) -> Reconciler:
    cluster.tokens()
    return Reconciler(KubeApi(cluster.api.api_client()), config)


def _data(resp) -> dict:
    return json.loads(resp.data)


class Cluster:
    """Creates objects through the real client, shaped like what Kubernetes controllers create."""

    def __init__(self, api):
        self.api = api
        c = api.api_client()
        self.core = client.CoreV1Api(c)
        self.batch = client.BatchV1Api(c)
        self.custom = client.CustomObjectsApi(c)

    def tokens(self, namespace: str = OPERATOR_NS, name: str = "gl-gpulens-tokens") -> dict:
        data = {k: base64.b64encode(f"{k}-token".encode()).decode() for k in ("agent", "coordinator", "gateway")}
        return _data(self.core.create_namespaced_secret(namespace, {"apiVersion": "v1", "kind": "Secret",
                                                                    "metadata": {"name": name}, "data": data},
                                                        _preload_content=False))

    def job(self, namespace: str, name: str, **spec: Any) -> dict:
        return _data(self.batch.create_namespaced_job(namespace, {"apiVersion": "batch/v1", "kind": "Job",
                                                                  "metadata": {"name": name},
                                                                  "spec": {"template": {"spec": {"containers": []}}, **spec}},
                                                      _preload_content=False))

    def pod(self, namespace: str, name: str, *, job: dict | None = None, attempt: int | None = None,
            armed: bool = True, labels: dict | None = None, lws: int = 4, phase: str | None = "Running") -> dict:
        lbl = dict(labels or {})
        meta: dict[str, Any] = {"name": name, "labels": lbl, "annotations": {"gpulens.dev/local-world-size": str(lws)}}
        if armed:
            lbl["gpulens.dev/armed"] = "true"
        if attempt is not None:
            lbl["gpulens.dev/attempt"] = str(attempt)
        if job is not None:
            jn = job["metadata"]["name"]
            lbl.update({"batch.kubernetes.io/job-name": jn, "job-name": jn})
            meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": jn,
                                        "uid": job["metadata"]["uid"], "controller": True,
                                        "blockOwnerDeletion": True}]
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}}
        pod = _data(self.core.create_namespaced_pod(namespace, body, _preload_content=False))
        return self.set_phase(namespace, name, phase) if phase else pod

    def set_phase(self, namespace: str, name: str, phase: str) -> dict:
        """What the kubelet does: write the pod's status subresource."""
        return _data(self.core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": phase}},
                                                           _content_type="application/merge-patch+json",
                                                           _preload_content=False))

    def delete_pod(self, namespace: str, name: str) -> None:
        self.core.delete_namespaced_pod(name, namespace, _preload_content=False)

    def delete_job(self, namespace: str, name: str) -> None:
        self.batch.delete_namespaced_job(name, namespace, _preload_content=False)

    def list(self, kind: str, namespace: str | None = None) -> list[dict]:
        if kind == "CaptureCoordinator":
            resp = (self.custom.list_namespaced_custom_object("gpulens.dev", "v1alpha1", namespace,
                                                              "capturecoordinators", _preload_content=False)
                    if namespace else
                    self.custom.list_cluster_custom_object("gpulens.dev", "v1alpha1", "capturecoordinators",
                                                           _preload_content=False))
        else:
            plural = {"Pod": "pod", "Service": "service", "ServiceAccount": "service_account",
                      "Secret": "secret"}[kind]
            fn = (getattr(self.core, f"list_namespaced_{plural}") if namespace else
                  getattr(self.core, f"list_{plural}_for_all_namespaces"))
            resp = fn(namespace, _preload_content=False) if namespace else fn(_preload_content=False)
        return _data(resp)["items"]

    def names(self, kind: str, namespace: str | None = None) -> set[str]:
        return {o["metadata"]["name"] for o in self.list(kind, namespace)}

    def coordinators(self, namespace: str | None = None) -> dict[str, dict]:
        return {o["metadata"]["name"]: o for o in self.list("CaptureCoordinator", namespace)}


def free_port_pair() -> tuple[int, int]:
    """Two distinct free ports on 127.0.0.1 (bound together, then released)."""
    import socket

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]
