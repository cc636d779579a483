"""Registration records (the trainer hook's files) as the no-Kubernetes attribution source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpulens.hooks import hook_path
from gpulens.exporter.attribution import Attributor, Workload, workload_id
from gpulens.exporter.procfs import ProcFS
from gpulens.exporter.registrations import RegistrationIndex

from .conftest import registration


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    time.sleep(0.05)
    yield p
    p.kill()
    p.wait(10)
    p.stdin.close()


def test_record_matches_by_pid_namespace_and_pid(tmp_path, child):
    registration(tmp_path, child.pid, "trainer-3", namespace="research", container="worker")
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    rec = index.match(child.pid)
    assert (rec.namespace, rec.pod, rec.container) == ("research", "trainer-3", "worker")
    assert rec.job_id == "job1"
    assert Attributor(ProcFS(), registrations=index).attribute(child.pid) == \
        Workload("research", "trainer-3", "worker", "registration", "job1", rank="0")   # the record's local_rank


def test_record_of_another_pid_namespace_does_not_match(tmp_path, child):
    registration(tmp_path, child.pid, "p", pid_namespace="pid:[1]", host_pid=None)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    assert index.match(child.pid) is None


def test_record_older_than_the_process_belongs_to_a_recycled_pid(tmp_path, child):
    registration(tmp_path, child.pid, "dead-pod", start_time=time.time() - 3600)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    assert index.match(child.pid) is None
    assert Attributor(ProcFS(), registrations=index).attribute(child.pid).namespace == "local"


def test_hook_written_record_is_understood(tmp_path, child):
    """A record built by the real hook code (hooks/site/_gpulens_hook.py), pid swapped to the child's."""
    sys.path.insert(0, str(hook_path()))
    try:
        import _gpulens_hook as hook
    finally:
        sys.path.pop(0)
    env = {"GPULENS_JOB_ID": "j", "GPULENS_POD_NAME": "hooked-pod", "GPULENS_NAMESPACE": "ns-h",
           "GPULENS_CONTAINER_NAME": "c-h", "RANK": "0", "WORLD_SIZE": "1"}
    rec = hook.build_record(env, child.pid, ["python", "train.py"], time.time())
    rec["host_pid"] = child.pid
    hook.write_atomically(str(tmp_path), hook.record_filename(rec), rec)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    got = index.match(child.pid)
    assert (got.namespace, got.pod, got.container, got.job_id) == ("ns-h", "hooked-pod", "c-h", "j")


def test_a_hook_record_names_its_serving_workload_and_the_series_carry_it(tmp_path, child):
    """Without Kubernetes (`gpulens up --demo --serving`), GPULENS_WORKLOAD is what says a pod is a
    replica of a Deployment: the record carries it (schema-valid) and gpulens_workload becomes it,
    while gpulens_job stays the revision, as the pod index gives them in a cluster."""
    from gpulens.capture import schemas
    sys.path.insert(0, str(hook_path()))
    try:
        import _gpulens_hook as hook
    finally:
        sys.path.pop(0)
    env = {"GPULENS_JOB_ID": "web-6d9f7c8b5", "GPULENS_POD_NAME": "web-6d9f7c8b5-x7k2p", "GPULENS_NAMESPACE": "serve",
           "GPULENS_WORKLOAD": "Deployment/web"}
    rec = hook.build_record(env, child.pid, ["python", "serve.py"], time.time())
    rec["host_pid"] = child.pid
    schemas.validate("registration", rec)
    hook.write_atomically(str(tmp_path), hook.record_filename(rec), rec)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    w = Attributor(ProcFS(), registrations=index).attribute(child.pid)
    assert (w.job, w.workload, workload_id(w)) == ("web-6d9f7c8b5", "Deployment/web", "Deployment/web")
    assert "workload" not in hook.build_record({"GPULENS_JOB_ID": "j"}, 1, [], 0.0)   # training: job/<id> as before


@pytest.mark.parametrize("value", ["Deployment", "/web", "Deployment/", "Deployment/web ok", "a" * 70 + "/w", 7])
def test_a_record_workload_that_is_no_kind_and_name_is_ignored(tmp_path, child, value):
    registration(tmp_path, child.pid, "p", workload=value)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    w = Attributor(ProcFS(), registrations=index).attribute(child.pid)
    assert w.workload == "" and workload_id(w) == "job/job1"


@pytest.mark.parametrize("content", [
    "not json", "[]", "{}", json.dumps({"namespace": "", "pod": "p", "pid": 5, "pid_namespace": "x"}),
    json.dumps({"namespace": "n", "pod": "p", "pid": "5", "pid_namespace": "x"}),
    json.dumps({"namespace": "n", "pod": "p", "pid": True, "pid_namespace": "x"}),
    json.dumps({"namespace": "n", "pod": "p", "pid": 5, "pid_namespace": "x", "host_pid": -1}),
    json.dumps({"namespace": "n", "pod": "p", "pid": 5, "pid_namespace": "x", "start_time": "yesterday"}),
])
def test_bad_files_are_counted_and_skipped(tmp_path, child, content):
    (tmp_path / "bad.json").write_text(content)
    registration(tmp_path, child.pid, "good")
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    index.refresh()                       # unchanged bad file: counted once
    assert index.errors == 1 and index.invalid == {str(tmp_path / "bad.json")}
    assert index.match(child.pid).pod == "good"
    (tmp_path / "bad.json").unlink()
    index.refresh()
    assert index.invalid == set()


def test_removed_and_rewritten_records_are_followed(tmp_path, child):
    path = registration(tmp_path, child.pid, "first")
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    assert index.match(child.pid).pod == "first"
    time.sleep(0.01)
    registration(tmp_path, child.pid, "second-name")   # same file name, new content (size differs)
    index.refresh()
    assert index.match(child.pid).pod == "second-name"
    path.unlink()
    index.refresh()
    assert index.match(child.pid) is None and len(index) == 0


def test_missing_or_unreadable_directory(tmp_path):
    index = RegistrationIndex(tmp_path / "nope", ProcFS())
    index.refresh()
    assert len(index) == 0 and index.errors == 0
    f = tmp_path / "file"
    f.write_text("")
    index = RegistrationIndex(f, ProcFS())   # not a directory
    index.refresh()
    assert index.errors == 1 and index.last_error


def test_no_record_and_no_kubernetes_means_local_and_process_name(child):
    w = Attributor(ProcFS()).attribute(child.pid)
    assert w == Workload("local", ProcFS().comm(child.pid), "", "local")
    assert w.job == ""
    assert Attributor(ProcFS()).attribute(2 ** 22 + 7) is None     # no such process
    assert os.path.exists(f"/proc/{child.pid}")


def test_job_id_that_is_not_a_string_gives_no_job_but_keeps_the_pod(tmp_path, child):
    registration(tmp_path, child.pid, "odd", job_id=7)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    w = Attributor(ProcFS(), registrations=index).attribute(child.pid)
    assert (w.pod, w.source, w.job) == ("odd", "registration", "")
