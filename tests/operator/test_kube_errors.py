"""KubeError says what the API server said: a log line with only "422 Unprocessable Entity" left a CI
failure undiagnosable. Bodies here are metav1.Status objects as kube-apiserver 1.20 writes them."""

from __future__ import annotations

import json

from kubernetes.client.rest import ApiException

from gpulens.capture.operator.kube import KubeError


def _exc(status: int, reason: str, body) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = body
    return exc


def test_an_invalid_objects_message_is_in_the_error():
    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422, "reason": "Invalid",
                       "message": 'CaptureCoordinator.gpulens.dev "gpulens-trainer-a0" is invalid: '
                                  'status.phase: Unsupported value: "Gone"',
                       "details": {"causes": [{"reason": "FieldValueNotSupported", "field": "status.phase"}]}})
    err = KubeError("patch capturecoordinator ml/gpulens-trainer-a0/status", _exc(422, "Unprocessable Entity", body))
    assert str(err).startswith("patch capturecoordinator ml/gpulens-trainer-a0/status: 422 Unprocessable Entity: ")
    assert 'status.phase: Unsupported value: "Gone"' in str(err)
    assert err.status == 422 and err.causes == ("FieldValueNotSupported",) and not err.namespace_terminating


def test_a_terminating_namespace_is_recognised_by_its_cause_or_its_message():
    causes = {"causes": [{"reason": "NamespaceTerminating", "message": "namespace ml is being terminated",
                          "field": "metadata.namespace"}]}
    with_cause = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "details": causes,
                             "message": "x is forbidden: unable to create new content in namespace ml because "
                                        "it is being terminated"}).encode()
    assert KubeError("create", _exc(403, "Forbidden", with_cause)).namespace_terminating
    message_only = json.dumps({"kind": "Status", "code": 403, "message": "unable to create new content in namespace "
                                                                         "ml because it is being terminated"})
    assert KubeError("create", _exc(403, "Forbidden", message_only)).namespace_terminating
    rbac = json.dumps({"kind": "Status", "code": 403, "message": 'pods is forbidden: User "system:serviceaccount:'
                                                                 'x:y" cannot create resource "pods"'})
    assert not KubeError("create", _exc(403, "Forbidden", rbac)).namespace_terminating


def test_bodies_that_are_not_a_status_leave_the_plain_line():
    for body in (None, b"", b"<html>502</html>", b"[1, 2]", '{"message": 7}', b"\xff\xfe"):
        err = KubeError("list pods", _exc(502, "Bad Gateway", body))
        assert str(err) == "list pods: 502 Bad Gateway" and err.causes == () and not err.namespace_terminating
    huge = json.dumps({"message": "m " * 5000})
    assert len(str(KubeError("list pods", _exc(500, "Internal", huge)))) < 500
    assert str(KubeError("list pods", ConnectionRefusedError("refused"))) == "list pods: ConnectionRefusedError"
