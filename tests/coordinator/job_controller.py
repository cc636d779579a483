"""A Job controller and kubelet double for the analysis Job tests.

It stands for kube-controller-manager's Job controller plus the kubelet of the node its pod lands
on, as the coordinator sees them through the API (tests/operator/apiserver.py stands for the API
server): for each new batch/v1 Job it sets `spec.selector` to the `batch.kubernetes.io/controller-uid`
label (the API server's defaulting), creates one pod from the template (labels `controller-uid`,
`batch.kubernetes.io/job-name`, `job-name`, owned by the Job), then, by `behaviour`:

- "run": runs the container's command for real (`gpulens` is this interpreter's `-m gpulens.cli`,
  with the container's env), then writes the pod's terminated state (`exitCode`, and for a
  non-zero exit with `FallbackToLogsOnError` the log tail as `message`, as the kubelet does) and
  the Job's `Complete` or `Failed` (BackoffLimitExceeded) condition;
- ("exit", code, log[, job failure reason]): the same without a process (e.g. 137 and
  "DeadlineExceeded": the kubelet killed it at the Job's activeDeadlineSeconds);
- "unschedulable": the pod stays Pending with PodScheduled False/Unschedulable, the Job never ends;
- "no-pod": nothing is created (a quota or admission refusal), the Job never ends.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
from typing import Any

from kubernetes import client

MERGE = "application/merge-patch+json"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class JobControllerDouble:
    def __init__(self, api, namespace: str, behaviour: Any = "run"):
        self.api, self.namespace, self.behaviour = api, namespace, behaviour
        self.batch = client.BatchV1Api(api.api_client())
        self.core = client.CoreV1Api(api.api_client())
        self.seen: set[str] = set()
        self.ran: list[list[str]] = []          # argv of each container really run
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-controller", daemon=True)

    def __enter__(self) -> "JobControllerDouble":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            raw = self.batch.list_namespaced_job(self.namespace, _preload_content=False)
            for job in json.loads(raw.data).get("items") or []:
                uid = job["metadata"]["uid"]
                # a selector: an earlier controller (a previous double) already ran this Job
                if uid not in self.seen and not (job.get("spec") or {}).get("selector"):
                    self.seen.add(uid)
                    try:
                        self._start(job)
                    except Exception as exc:   # kept for the test to see, the loop goes on
                        self.errors.append(exc)

    def _start(self, job: dict) -> None:
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
        selector = {"batch.kubernetes.io/controller-uid": uid}
        self.batch.patch_namespaced_job(name, self.namespace, {"spec": {"selector": {"matchLabels": selector}}},
                                        _preload_content=False, _content_type=MERGE)
        if self.behaviour == "no-pod":
            return
        template = job["spec"]["template"]
        labels = {**(template["metadata"].get("labels") or {}), **selector, "controller-uid": uid,
                  "batch.kubernetes.io/job-name": name, "job-name": name}
        pod_name = f"{name}-x7k2q"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "labels": labels,
                            "annotations": template["metadata"].get("annotations") or {},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                                 "controller": True, "blockOwnerDeletion": True}]},
               "spec": template["spec"]}
        self.core.create_namespaced_pod(self.namespace, pod, _preload_content=False)
        if self.behaviour == "unschedulable":
            self._pod_status(pod_name, {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient memory."}]})
            return
        if self.behaviour == "run":
            container = template["spec"]["containers"][0]
            code, log = self._run(container)
        else:
            _, code, log, *_ = self.behaviour
        container = template["spec"]["containers"][0]
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        if code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            terminated["message"] = "\n".join(log.splitlines()[-80:])[-2048:]
        self._pod_status(pod_name, {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
            {"name": container["name"], "ready": False, "restartCount": 0, "image": container["image"],
             "state": {"terminated": terminated}}]})
        cond = ({"type": "Complete", "status": "True"} if code == 0 else
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                 "message": "Job has reached the specified backoff limit"})
        if isinstance(self.behaviour, tuple) and len(self.behaviour) > 3:   # ("exit", 137, log, "DeadlineExceeded")
            cond = {"type": "Failed", "status": "True", "reason": self.behaviour[3],
                    "message": "Job was active longer than specified deadline"}
        self.batch.patch_namespaced_job_status(name, self.namespace,
                                               {"status": {"conditions": [{**cond, "lastTransitionTime": _now()}],
                                                           "succeeded" if code == 0 else "failed": 1}},
                                               _preload_content=False, _content_type=MERGE)

    def _run(self, container: dict) -> tuple[int, str]:
        assert container["command"] == ["gpulens"], container["command"]
        argv = [sys.executable, "-m", "gpulens.cli", *container["args"]]
        self.ran.append(argv)
        env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        return proc.returncode, proc.stdout + proc.stderr

    def _pod_status(self, name: str, status: dict) -> None:
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status}, _preload_content=False,
                                              _content_type=MERGE)
