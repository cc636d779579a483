"""Cost of the operator's slow path and of the arming webhook, measured side by side in one run.

    .venv/bin/python bench/operator_reconcile.py [--api-jobs 10] [--plan-jobs 100 1000 5000] [--runs 5]

1. API requests per job of a resync against the test API server (kmock-based,
   tests/operator/apiserver.py, real `kubernetes` client over HTTP): the first resync (creates
   everything) versus a steady-state one (nothing to do). Exact counts; wall time through the
   mock is not reported (kmock scans all objects per request, so it measures the mock).
2. The operator's own CPU per resync: grouping pods and planning every job (pure functions), by
   number of jobs, versus the cost of merely decoding the pod list JSON it plans from.
3. Arming: `arm_pod` plus encoding the answer, versus just decoding and re-encoding the same
   AdmissionReview (the work any webhook does), per pod.
4. Readiness from events (`--readiness-runs`): `gpulens operator` as a process with its resync
   set to an hour, against the test API server emulating Kubernetes 1.20's ServiceAccount token
   admission (a new coordinator's Pod is refused until its token exists, `--token-delay-s`
   later). Seconds from a new job's first armed pod to its coordinator Pod and Service, and from
   `delete capturecoordinator` to the CR, its Pod and its Service back; next to the chart's
   default resync interval, the bound before coordinators followed events.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpulens.capture.operator.config import ArmingConfig  # noqa: E402
from gpulens.capture.operator.kube import KubeApi  # noqa: E402
from gpulens.capture.operator.reconcile import Reconciler  # noqa: E402
from gpulens.capture.operator.webhook import review_response  # noqa: E402
from tests.operator.apiserver import running_apiserver  # noqa: E402
from tests.operator.conftest import Cluster, operator_config  # noqa: E402
from tests.operator.test_arming import job_pod  # noqa: E402
from tests.operator.test_webhook import review  # noqa: E402


def api_round(n_jobs: int) -> dict[str, float]:
    with running_apiserver() as api:
        cluster = Cluster(api)
        cluster.tokens()
        for j in range(n_jobs):
            job = cluster.job("ml", f"job-{j}")
            for p in range(2):
                cluster.pod("ml", f"job-{j}-{p}", job=job)
        r = Reconciler(KubeApi(api.api_client()), operator_config())
        out = {}
        for phase in ("first", "steady"):
            mark = len(api.server.log)
            r.resync()
            reqs = api.server.log[mark:]
            out[f"{phase}_requests"] = len(reqs)
            out[f"{phase}_writes"] = sum(1 for m, _, _ in reqs if m != "GET")
        assert len(cluster.coordinators("ml")) == n_jobs
        return out


def plan_round(n_jobs: int, pods_per_job: int = 4) -> tuple[float, float]:
    """(seconds to json-decode the pod list, seconds to group + plan all jobs) for one resync."""
    from gpulens.capture.operator.planning import coordinators_by_job, group_pods, plan_job
    pods = []
    for j in range(n_jobs):
        for p in range(pods_per_job):
            pod = job_pod()
            pod["metadata"].update(name=f"job-{j}-{p}", uid=f"u-{j}-{p}")
            pod["metadata"]["labels"].update({"gpulens.dev/armed": "true", "batch.kubernetes.io/job-name": f"job-{j}",
                                              "job-name": f"job-{j}"})
            pod["metadata"]["ownerReferences"][0].update(name=f"job-{j}", uid=f"j-{j}")
            pod["status"] = {"phase": "Running"}
            pods.append(pod)
    text = json.dumps({"items": pods})
    cfg = operator_config()
    t0 = time.perf_counter()
    items = json.loads(text)["items"]
    decode = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups = group_pods(items)
    by_job = coordinators_by_job([])
    plans = [plan_job(k, job, ps, by_job.get(k, []), True, cfg) for k, (job, ps) in groups.items()]
    plan = time.perf_counter() - t0
    assert len(plans) == n_jobs and all(p.create for p in plans)
    return decode, plan


def arming_round(n: int = 2000) -> tuple[float, float]:
    body = json.dumps(review(job_pod())).encode()
    cfg, image = ArmingConfig(), "registry.example.com/gpulens:0.1.0"
    t0 = time.perf_counter()
    for _ in range(n):
        json.dumps(json.loads(body)).encode()
    base = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        out = review_response(json.loads(body), cfg, image)
        json.dumps(out).encode()
    armed = (time.perf_counter() - t0) / n
    assert json.loads(base64.b64decode(out["response"]["patch"]))
    return base, armed


def _until(predicate, timeout: float = 120.0) -> float:
    """Monotonic time at which `predicate()` first held (polled every 100 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError("not reached")


def readiness_rounds(runs: int, token_delay_s: float) -> list[dict[str, float]]:
    """Seconds to coordinator Pod / Service for new jobs, and back after a CR deletion."""
    import shutil

    from tests.operator.test_command import Proc, _files

    exe = str(Path(sys.executable).with_name("gpulens")) if Path(sys.executable).with_name("gpulens").exists() \
        else shutil.which("gpulens") or "gpulens"
    out = []
    with running_apiserver(token_delay_s=token_delay_s) as api, tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(api)
        cluster.tokens()
        cfg, kc = _files(Path(tmp), api, resync_interval_s=3600)
        op = Proc([exe, "operator", "--config", str(cfg), "--kubeconfig", str(kc), "--log-level", "debug",
                   "--listen", "127.0.0.1:0"], Path(tmp) / "operator.log")
        try:
            _until(lambda: "event=resync.done" in op.text())
            for i in range(runs):
                name = f"job-{i}"
                cc = f"gpulens-{name}-a0"
                t0 = time.monotonic()
                job = cluster.job("ml", name)
                cluster.pod("ml", f"{name}-0", job=job)
                cluster.pod("ml", f"{name}-1", job=job)
                t_pod = _until(lambda: cc in cluster.names("Pod", "ml"))
                t_svc = _until(lambda: f"gpulens-{name}" in cluster.names("Service", "ml"))
                old = cluster.coordinators("ml")[cc]["metadata"]["uid"]
                d0 = time.monotonic()
                cluster.custom.delete_namespaced_custom_object("gpulens.dev", "v1alpha1", "ml",
                                                               "capturecoordinators", cc)

                def back():
                    c = cluster.coordinators("ml").get(cc)
                    return c is not None and c["metadata"]["uid"] != old
                d_cc = _until(back)
                new = cluster.coordinators("ml")[cc]["metadata"]["uid"]

                def owned(kind: str, obj_name: str) -> bool:
                    return any(o["metadata"]["name"] == obj_name and
                               [r["uid"] for r in o["metadata"].get("ownerReferences", [])] == [new]
                               for o in cluster.list(kind, "ml"))
                d_pod = _until(lambda: owned("Pod", cc))
                d_svc = _until(lambda: owned("Service", f"gpulens-{name}"))
                out.append({"new_pod": t_pod - t0, "new_svc": t_svc - t0, "del_cc": d_cc - d0,
                            "del_pod": d_pod - d0, "del_svc": d_svc - d0})
        finally:
            op.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api-jobs", type=int, default=10)
    ap.add_argument("--plan-jobs", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--readiness-runs", type=int, default=5, help="jobs created and CRs deleted (0: skip)")
    ap.add_argument("--token-delay-s", type=float, default=0.5,
                    help="the emulated token controller's delay after a ServiceAccount is created")
    args = ap.parse_args()
    from gpulens.ground.logs import setup_logging
    setup_logging("error")

    r = api_round(args.api_jobs)
    n = args.api_jobs
    print(f"| API requests per job ({n} jobs, 2 pods each) | requests/job | writes/job |")
    print("|---|---|---|")
    print(f"| first resync (creates) | {r['first_requests'] / n:.1f} | {r['first_writes'] / n:.1f} |")
    print(f"| steady resync (nothing to do) | {r['steady_requests'] / n:.1f} | {r['steady_writes'] / n:.1f} |")

    print()
    print("| jobs (4 pods each) | decode pod list | group + plan | plan per job | plan / decode |")
    print("|---|---|---|---|---|")
    for jobs in args.plan_jobs:
        pairs = [plan_round(jobs) for _ in range(args.runs)]
        dec = statistics.median(p[0] for p in pairs)
        pl = statistics.median(p[1] for p in pairs)
        print(f"| {jobs} | {1000 * dec:.1f} ms | {1000 * pl:.1f} ms | {1e6 * pl / jobs:.0f} µs | {pl / dec:.1f}x |")

    pairs = [arming_round() for _ in range(args.runs)]
    base = statistics.median(p[0] for p in pairs)
    armed = statistics.median(p[1] for p in pairs)
    print()
    print("| per admission review | median |")
    print("|---|---|")
    print(f"| decode + re-encode only | {1e6 * base:.0f} µs |")
    print(f"| decode + arm_pod + encode answer | {1e6 * armed:.0f} µs ({armed / base:.1f}x) |")

    if args.readiness_runs:
        rounds = readiness_rounds(args.readiness_runs, args.token_delay_s)
        resync = operator_config().resync_interval_s
        print()
        print(f"| readiness, operator resync 3600 s, token delay {args.token_delay_s:g} s "
              f"({len(rounds)} runs) | median s | max s | resync default / median |")
        print("|---|---|---|---|")
        for key, what in (("new_pod", "new job: first pod -> coordinator Pod"),
                          ("new_svc", "new job: first pod -> Service"),
                          ("del_cc", "CR deleted -> CR back"), ("del_pod", "CR deleted -> Pod back"),
                          ("del_svc", "CR deleted -> Service re-owned")):
            vals = [r[key] for r in rounds]
            med = statistics.median(vals)
            print(f"| {what} | {med:.2f} | {max(vals):.2f} | {resync / med:.0f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
