"""The chart's RBAC for the operator is enough for every call the operator really makes (and the
chart's own operator config drives it), so least privilege does not mean a broken operator."""

from __future__ import annotations

import yaml

from gpulens.capture.operator.config import OperatorConfig
from gpulens.capture.operator.job_attempts import JobAttempts
from gpulens.capture.operator.kube import KubeApi
from gpulens.capture.operator.leadership import LeaseElector
from gpulens.capture.operator.reconcile import Reconciler

from ..helm.chart import NAMESPACE, one, render
from .rbac import allowed, attributes

UA = "gpulens-operator-under-test"


def _chart():
    objs = render({"archive": {"existingSecret": "s3-creds"}})
    cfg = OperatorConfig.from_dict(yaml.safe_load(one(objs, "ConfigMap", "-operator")["data"]["operator.yaml"]))
    cluster_rules = one(objs, "ClusterRole", "-operator")["rules"]
    ns_rules = {NAMESPACE: one(objs, "Role", "-operator")["rules"]}
    return cfg, cluster_rules, ns_rules


def test_every_operator_request_is_allowed_by_the_chart_rbac(apiserver, cluster):
    cfg, cluster_rules, ns_rules = _chart()
    assert cfg.namespace == NAMESPACE
    cluster.tokens(NAMESPACE, cfg.tokens_secret)
    cluster.core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": "s3-creds"}, "data": {"K": "dg=="}},
                                          _preload_content=False)
    client = apiserver.api_client()
    client.user_agent = UA
    r = Reconciler(KubeApi(client), cfg)
    elector = LeaseElector(client, cfg.namespace, cfg.leader_election.lease_name, "op-0")
    assert elector.try_acquire() and elector.try_acquire()      # create, then update (renew)
    elector.release()

    job = cluster.job("ml", "llama")
    # The webhook's read (get the Job, list its failed pods) for a pod the Job controller submits.
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "llama", "uid": job["metadata"]["uid"], "controller": True}
    assert JobAttempts(KubeApi(client)).attempt_of(
        {"metadata": {"labels": {"job-name": "llama"}, "ownerReferences": [owner]}}, "ml") == 0
    cluster.pod("ml", "llama-0", job=job, attempt=0)
    r.reconcile_job("ml", "llama")
    r.resync()
    cluster.pod("ml", "llama-1", job=job, attempt=1)            # attempt bump: service handover
    r.reconcile_job("ml", "llama")
    cluster.delete_pod("ml", "gpulens-llama-a1")                 # lost coordinator pod
    r.resync()
    cluster.delete_job("ml", "llama")
    r.reconcile_job("ml", "llama")

    made = apiserver.requests_by(UA)
    verbs = {attributes(*req).verb for req in made if attributes(*req)}
    assert {"create", "get", "list", "update", "patch", "delete"} <= verbs   # the scenario covered them all
    denied = [req for req in made if attributes(*req) and not allowed(attributes(*req), cluster_rules, ns_rules)]
    assert denied == []


def test_the_evaluator_denies_what_the_chart_does_not_grant():
    _, cluster_rules, ns_rules = _chart()
    for req in [("GET", "/api/v1/secrets", ""),                                   # list secrets cluster-wide
                ("GET", "/api/v1/namespaces/ml/secrets/anything", ""),            # read a job namespace secret
                ("PATCH", "/api/v1/namespaces/ml/pods/trainer-0", ""),             # touch a trainer pod
                ("PUT", "/apis/coordination.k8s.io/v1/namespaces/gpulens-system/leases/other", ""),
                ("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/not-ours", "")]:
        assert not allowed(attributes(*req), cluster_rules, ns_rules), req
    assert allowed(attributes("GET", "/api/v1/pods", "labelSelector=x&watch=true"), cluster_rules, ns_rules)
