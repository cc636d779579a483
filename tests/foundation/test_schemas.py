"""The capture contracts reject bad input and name the field; good input round-trips through models."""

from __future__ import annotations

import copy

import pytest

from gpulens.capture import schemas
from gpulens.capture.models import (Artifact, CaptureRequest, Dispatch, ExpectedTarget, Failure, Manifest,
                            RegistrationRecord, TargetState, TargetStatus, TriggerAttempt, new_capture_id)
from gpulens.capture.models.states import MAX_TRIGGER_ATTEMPTS

RECORD = {
    "schema_version": 1, "job_id": "job-a", "attempt": 0, "namespace": "ml", "pod": "job-a-0", "pod_uid": "u-1",
    "container": "trainer", "node": "n1", "global_rank": 3, "local_rank": 1, "world_size": 4,
    "local_world_size": 2, "pid": 37, "pid_namespace": "pid:[4026532000]", "kineto_job_id": 1234,
    "start_time": 1.5, "trace_dir": "/tmp", "socket_dir": "/run/gpulens",
}
WRONG_TYPES = {"job_id": 5, "attempt": "0", "namespace": None, "pod": [], "pod_uid": 1, "container": 2, "node": {},
               "global_rank": "3", "local_rank": -1, "world_size": 0, "local_world_size": 1.5, "pid": 0,
               "pid_namespace": 7, "kineto_job_id": 2**31, "start_time": "now", "trace_dir": 1, "socket_dir": None,
               "schema_version": 2}

ARTIFACT = {"target_id": "rank-0", "rank": 0, "local_rank": 0, "node": "n1", "pod": "p0", "pid": 37, "attempt": 0,
            "uri": "file:///a/traces/rank-0.json", "size": 10, "sha256": "a" * 64, "trace_id": "123"}


@pytest.mark.parametrize("field", sorted(schemas.load("registration")["required"]))
def test_registration_missing_field_is_named(field):
    bad = {k: v for k, v in RECORD.items() if k != field}
    with pytest.raises(schemas.SchemaError) as exc:
        RegistrationRecord.from_dict(bad)
    assert exc.value.field == field


@pytest.mark.parametrize("field,value", sorted(WRONG_TYPES.items()))
def test_registration_wrong_type_is_named(field, value):
    bad = dict(RECORD, **{field: value})
    with pytest.raises(schemas.SchemaError) as exc:
        RegistrationRecord.from_dict(bad)
    assert exc.value.field == field, str(exc.value)


def test_registration_round_trip_and_base_rank():
    rec = RegistrationRecord.from_dict(RECORD)
    assert rec.base_rank == 2
    assert RegistrationRecord.from_dict(rec.to_dict()) == rec


REQUEST = {"job_id": "job-a", "duration_ms": 2000, "activities": ["cpu_op"], "options": {"with_stack": True},
           "reason": {"kind": "alert", "fingerprint": "abc", "starts_at": "2026-11-29T00:00:00Z"}, "requested_by": "am"}


@pytest.mark.parametrize("mutation,field", [
    ({"job_id": None}, "job_id"),
    ({"job_id": "bad id with spaces"}, "job_id"),
    ({"duration_ms": "2000"}, "duration_ms"),
    ({"duration_ms": 10}, "duration_ms"),
    ({"activities": ["cpu_op", "bogus_type"]}, "activities[1]"),
    ({"activities": ["cuda_sync"]}, "activities[0]"),      # newer name: not safe for unknown Kineto versions
    ({"activities": []}, "activities"),
    ({"options": {"with_stacks": True}}, "options.with_stacks"),
    ({"reason": {"kind": "pager"}}, "reason.kind"),
    ({"extra": 1}, "extra"),
])
def test_capture_request_rejections_name_the_field(mutation, field):
    bad = dict(copy.deepcopy(REQUEST), **mutation)
    with pytest.raises(schemas.SchemaError) as exc:
        CaptureRequest.from_dict(bad)
    assert exc.value.field == field, str(exc.value)


def test_capture_request_missing_job_named():
    with pytest.raises(schemas.SchemaError) as exc:
        CaptureRequest.from_dict({"duration_ms": 1000})
    assert exc.value.field == "job_id"


def test_capture_request_round_trip():
    req = CaptureRequest.from_dict(REQUEST)
    assert req.options.with_stack and req.activities == ("cpu_op",)
    assert CaptureRequest.from_dict(req.to_dict()) == req


def test_capture_ids_are_unique_and_valid():
    ids = {new_capture_id() for _ in range(200)}
    assert len(ids) == 200
    for cid in list(ids)[:5]:
        schemas.validate("capture_request", dict(REQUEST, capture_id=cid))


@pytest.mark.parametrize("field", sorted(ARTIFACT))
def test_manifest_artifact_missing_field_rejected(field):
    with pytest.raises(schemas.SchemaError) as exc:
        Artifact.from_dict({k: v for k, v in ARTIFACT.items() if k != field})
    assert exc.value.field.endswith(field)


@pytest.mark.parametrize("field,value", [("sha256", "xyz"), ("uri", "http://x/y"), ("size", 0), ("pid", "37"),
                                         ("rank", -1), ("attempt", None)])
def test_manifest_artifact_wrong_values_rejected(field, value):
    with pytest.raises(schemas.SchemaError) as exc:
        Artifact.from_dict(dict(ARTIFACT, **{field: value}))
    assert exc.value.field.endswith(field)


def _manifest() -> Manifest:
    return Manifest(capture_id="c-1", job_id="job-a", attempt=0, requested_at=1.0, duration_ms=1000,
                    expected_targets=[ExpectedTarget("rank-0", 0, 0, "p0", "n1"), ExpectedTarget("rank-1", 1, 1, "p0", "n1")],
                    artifacts=[Artifact(**ARTIFACT)],
                    failures=[Failure("rank-1", "process_gone", "pid 38 exited", rank=1)])


def test_manifest_round_trip_and_success_accounting():
    m = _manifest()
    again = Manifest.from_json(m.to_json())
    assert again.to_dict() == m.to_dict()
    assert not m.fully_succeeded and m.missing_ranks == [1]
    m.failures.clear()
    m.artifacts.append(Artifact(**dict(ARTIFACT, target_id="rank-1", rank=1, local_rank=1)))
    assert m.fully_succeeded and m.missing_ranks == []


def test_manifest_with_no_expected_targets_is_not_a_success():
    m = _manifest()
    m.expected_targets, m.artifacts, m.failures = [], [], []
    assert not m.fully_succeeded


def test_manifest_failure_reason_must_be_known():
    d = _manifest().to_dict()
    d["failures"][0]["reason"] = "oops"
    with pytest.raises(schemas.SchemaError) as exc:
        Manifest.from_dict(d)
    assert exc.value.field == "failures[0].reason"


def test_target_status_failed_requires_reason_and_archived_requires_artifact():
    with pytest.raises(schemas.SchemaError):
        TargetStatus.from_dict({"target_id": "rank-0", "state": "failed"})
    with pytest.raises(schemas.SchemaError):
        TargetStatus.from_dict({"target_id": "rank-0", "state": "archived", "artifact": None})
    ok = TargetStatus.from_dict({"target_id": "rank-0", "state": "archived", "artifact": ARTIFACT})
    assert ok.state is TargetState.ARCHIVED and ok.terminal
    assert TargetStatus.from_dict(ok.to_dict()).artifact == ok.artifact


def test_trigger_attempts_keep_dynolog_s_fields_merge_repeats_and_stay_bounded():
    st = TargetStatus("rank-0", TargetState.NOT_MATCHED)
    assert st.record_attempt(TriggerAttempt(1.0, "dynolog", processes_matched=[], triggered=[], busy=0))
    assert not st.record_attempt(TriggerAttempt(2.0, "dynolog", processes_matched=[], triggered=[], busy=0))
    assert st.record_attempt(TriggerAttempt(3.0, "dynolog", error="dynolog_unreachable"))
    assert st.record_attempt(TriggerAttempt(4.0, "dynolog", processes_matched=[37], triggered=[37], busy=0))
    wire = st.to_dict()
    assert wire["trigger_attempts"][0] == {"at": 1.0, "last_at": 2.0, "backend": "dynolog", "count": 2,
                                           "processesMatched": [], "activityProfilersTriggered": [],
                                           "activityProfilersBusy": 0}
    assert wire["trigger_attempts"][1] == {"at": 3.0, "backend": "dynolog", "count": 1, "error": "dynolog_unreachable"}
    back = TargetStatus.from_dict(wire)  # validated against target_status.schema.json
    assert back.trigger_attempts == st.trigger_attempts
    for i in range(3 * MAX_TRIGGER_ATTEMPTS):  # alternating answers: each is a new entry
        st.record_attempt(TriggerAttempt(10.0 + i, "builtin", processes_matched=[37], triggered=[], busy=i % 2))
    assert len(st.trigger_attempts) == MAX_TRIGGER_ATTEMPTS and st.trigger_attempts[-1].at == 10.0 + 3 * MAX_TRIGGER_ATTEMPTS - 1
    TargetStatus.from_dict(st.to_dict())
    # an answer and an error in one entry, or a half answer, is not a dynolog answer
    for bad in ({"at": 1.0, "backend": "dynolog", "count": 1, "error": "x", "processesMatched": []},
                {"at": 1.0, "backend": "dynolog", "count": 1, "processesMatched": [1]},
                {"at": 1.0, "backend": "other", "count": 1, "error": "x"},
                {"at": 1.0, "backend": "dynolog", "count": 0, "error": "x"}):
        with pytest.raises(schemas.SchemaError):
            TargetStatus.from_dict({"target_id": "rank-0", "state": "pending", "trigger_attempts": [bad]})
    too_many = [{"at": 1.0, "backend": "dynolog", "count": 1, "error": "x"}] * (MAX_TRIGGER_ATTEMPTS + 1)
    with pytest.raises(schemas.SchemaError):
        TargetStatus.from_dict({"target_id": "rank-0", "state": "pending", "trigger_attempts": too_many})


def test_dispatch_round_trip_and_rejects_unknown_activity():
    d = Dispatch(job_id="j", attempt=0, rank=0, duration_ms=1000, activities=("cpu_op",), deadline=5.0,
                 archive_prefix="file:///tmp/a/c-1")
    assert Dispatch.from_dict(d.to_dict()) == d
    with pytest.raises(schemas.SchemaError) as exc:
        Dispatch.from_dict(dict(d.to_dict(), activities=["cpu_op", "gpu_ops"]))
    assert exc.value.field == "activities[1]"
