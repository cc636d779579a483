"""Analysis on the chart's Dask cluster (issue 28), in the real cluster: the release upgraded to
`dask.enabled=true` with two workers, the operator picks the scheduler up (its ConfigMap's checksum
rolls its pods) and gives it to the job's coordinator, whose analysis Job submits each rank of a
gateway-started capture to the scheduler: the ranks run on the worker pods (each rank's summary in
the archive names the worker pod it ran on) and the report is written. Then a worker pod is deleted
while it analyses a rank: the scheduler retries that rank on another worker (or reports it
`unanalysable` with the reason) and the report is written for every rank.

test_7 replaces release `gl` with the README trial's `lens` (one node, one release): `gl` is put
back first, with the README's values, then upgraded as a user would (`helm upgrade --reuse-values
--set dask.enabled=true,...`), and returned to the README's values at the end (Dask off)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from .harness import CHART, NS, RELEASE, REPO, pod_log, readme_install, wait_until
from .workload import (
    JOB,
    armed_namespace,
    capture_status,
    start_capture,
    start_trainer,
    wait_converged,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

SCHEDULER = f"tcp://{RELEASE}-gpulens-dask-scheduler.{NS}.svc:8786"
WORKER_SEL = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=dask-worker"
SCHED_SEL = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=dask-scheduler"
OPERATOR_SEL = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
ANALYSIS = "app.kubernetes.io/component=analysis"
#: What the test sets on the release (as `--set`): two workers; a small CPU request, so a third
#: (the Deployment's replacement of the deleted one) still fits the 2-CPU node beside the trainer.
DASK = {"dask": {"enabled": True, "workers": {"replicas": 2,
                                             "resources": {"requests": {"cpu": "100m", "memory": "512Mi"},
                                                           "limits": {"memory": "4Gi"}}}}}
#: the trace's length for the capture whose worker is deleted: long enough that its rank is still
#: being analysed when the pod dies (the deletion lands within ~1 s of the rank's fetch)
LONG_CAPTURE_MS = 6000


def _ready(pods) -> list:
    return [p for p in pods if not p.metadata.deletion_timestamp and p.status.container_statuses
            and all(c.ready for c in p.status.container_statuses)]


def _operator_config(api) -> dict:
    import yaml
    (cm,) = [c for c in api.list_namespaced_config_map(NS, label_selector=OPERATOR_SEL).items
             if c.metadata.name.endswith("-operator")]
    return yaml.safe_load(cm.data["operator.yaml"])


def _operator_current(api):
    """Every operator pod from the Deployment's current template (the ConfigMap's checksum in its
    annotations), Ready, as many as its replicas, none terminating: the pods run the config now in
    the ConfigMap (the operator reads it at start)."""
    from kubernetes import client
    dep = next(d for d in client.AppsV1Api(api.api_client).list_namespaced_deployment(
        NS, label_selector=OPERATOR_SEL).items)
    want = dep.spec.template.metadata.annotations["checksum/config"]
    pods = api.list_namespaced_pod(NS, label_selector=OPERATOR_SEL).items
    current = _ready([p for p in pods if (p.metadata.annotations or {}).get("checksum/config") == want])
    return len(pods) == len(current) == dep.spec.replicas and current


def _upgrade(cluster, api, values: dict, *, reuse: bool) -> float:
    """`helm upgrade gl` (reuse: --reuse-values plus `values` as --set; else exactly `values`),
    waited on, then the operator's pods all from the new template: the scheduler reaches the
    operator through its ConfigMap, read at start; the pod template's checksum of that ConfigMap
    rolls the Deployment when it changes. Returns the seconds until then."""
    from helm_python import Config
    t0 = time.monotonic()
    Config(kubeconfig_path=cluster.kubeconfig, namespace=NS).upgrade(
        str(CHART), RELEASE, values, namespace=NS, wait="watcher", timeout=600,
        reuse_values=reuse, reset_values=not reuse)
    wait_until("the operator's pods from the upgraded template, Ready", lambda: _operator_current(api), 300, 1)
    return time.monotonic() - t0


def _release_gl(cluster, api, gpulens_image, s3, grafana, work: Path) -> dict:
    """Release `gl` as the `release` fixture installs it (the README's lines), the trial's `lens`
    uninstalled first if test_7 left it (its host-network agent holds the node's ports). Returns
    gl's user-supplied values."""
    from helm_python import Config

    from .readme_install import TRIAL_MARKS, Install
    trial = Install.from_readme(REPO / "README.md", {"VERSION": "x", "ARCHIVE_DIR": "/x"}, TRIAL_MARKS).helm.args
    cfg = Config(kubeconfig_path=cluster.kubeconfig, namespace=trial["namespace"])
    if any(r.get("name") == trial["release"] for r in cfg.list(name_filter=f"^{trial['release']}$") or []):
        cfg.uninstall(trial["release"], wait="watcher", timeout=300)
        wait_until(f"release {trial['release']}'s pods gone", lambda: not [
            p for p in api.list_namespaced_pod(trial["namespace"]).items
            if (p.metadata.labels or {}).get("app.kubernetes.io/instance") == trial["release"]], 300, 1)
    install = readme_install(gpulens_image, s3.endpoint, grafana.url)
    install.run(cluster.kubeconfig, REPO, work, rerun=True)     # `gl` was installed by these lines before
    wait_until(f"release {RELEASE}'s pods Ready", lambda: (lambda pods: pods and len(_ready(pods)) == len(pods))(
        api.list_namespaced_pod(NS).items), 300, 1)
    return Config(kubeconfig_path=cluster.kubeconfig, namespace=NS).get_values(RELEASE)


@pytest.fixture(scope="module")
def dask_release(cluster, api, gpulens_image, s3, grafana, release, tmp_path_factory) -> dict:
    """gl upgraded to its own two-worker Dask cluster; back to the README's values at the end."""
    readme_values = _release_gl(cluster, api, gpulens_image, s3, grafana, tmp_path_factory.mktemp("readme-gl"))
    assert not (readme_values.get("dask") or {}).get("enabled"), readme_values
    assert _operator_config(api)["coordinator"]["analysis_scheduler"] == ""
    try:
        rolled_s = _upgrade(cluster, api, DASK, reuse=True)
        wait_until("the Dask scheduler and two workers Ready", lambda: (
            len(_ready(api.list_namespaced_pod(NS, label_selector=SCHED_SEL).items)) == 1
            and len(_ready(api.list_namespaced_pod(NS, label_selector=WORKER_SEL).items)) == 2), 300, 1)
        yield {"upgrade_s": rolled_s}
    finally:
        _upgrade(cluster, api, readme_values, reuse=False)
        wait_until("the Dask pods gone", lambda: not api.list_namespaced_pod(
            NS, label_selector="app.kubernetes.io/component in (dask-scheduler,dask-worker)").items, 300, 1)
        assert _operator_config(api)["coordinator"]["analysis_scheduler"] == ""


@pytest.fixture(scope="module")
def trainer(dask_release, api, gpulens_image):
    """The two-rank training Job in its own armed namespace, started after the upgrade (its
    coordinator is made by an operator that knows the scheduler); the namespace is deleted and
    waited on until it is gone (a later module's checks must not see it terminating)."""
    from kubernetes.client.rest import ApiException
    ns = armed_namespace(api)
    try:
        yield ns, start_trainer(api, ns, gpulens_image)
    finally:
        api.delete_namespace(ns)

        def gone():
            try:
                api.read_namespace(ns)
            except ApiException as e:
                return e.status == 404
            return False
        wait_until(f"namespace {ns} deleted", gone, 300, 1)


def _analysed(api, cid: str, timeout: float = 900) -> dict:
    return wait_until(f"capture {cid}'s analysis finished", lambda: (
        lambda st: st.get("phase") == "failed" and st or (
            st.get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled") and st))(
        capture_status(api, cid)), timeout, 2)


def _s3_json(s3, uri: str) -> dict:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return json.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def _rank_summaries(s3, manifest_uri: str) -> dict[int, dict]:
    """Each archived rank's own summary, written next to its trace by the worker that analysed it
    (none for a rank no worker finished)."""
    from gpulens.capture.analysis.rank_work import rank_summary_key
    prefix = manifest_uri.rsplit("/", 1)[0]
    out = {}
    for a in _s3_json(s3, manifest_uri)["artifacts"]:
        try:
            out[a["rank"]] = _s3_json(s3, f"{prefix}/{rank_summary_key(prefix, a['uri'])}")
        except s3.client().exceptions.NoSuchKey:
            pass
    return out


def _job_pod(api, ns: str, job_name: str):
    (pod,) = [p for p in api.list_namespaced_pod(ns, label_selector=ANALYSIS).items
              if (p.metadata.labels or {}).get("job-name") == job_name]
    return pod


def _events(log: str, event: str) -> list[dict[str, str]]:
    """The logfmt lines of `event` as dicts (quoted values unquoted)."""
    out = []
    for line in log.splitlines():
        if f"event={event} " in line + " ":
            out.append({k: v.strip('"') for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)})
    return out


def _log_seconds(log: str, first: str, last: str) -> float:
    from datetime import datetime
    ts = [datetime.strptime(_events(log, e)[0]["ts"], "%Y-%m-%dT%H:%M:%S.%fZ") for e in (first, last)]
    return (ts[1] - ts[0]).total_seconds()


def test_the_operator_gives_the_new_scheduler_to_the_jobs_coordinator(dask_release, trainer, api, capsys):
    """The upgrade reached the operator (ConfigMap, then the rolled pods), and its coordinator for
    a job started afterwards runs with --analysis-scheduler."""
    ns, _ = trainer
    assert _operator_config(api)["coordinator"]["analysis_scheduler"] == SCHEDULER
    (coord,) = wait_until("coordinator pod Ready", lambda: _ready(api.list_namespaced_pod(
        ns, label_selector="app.kubernetes.io/component=coordinator").items), 300)
    args = coord.spec.containers[0].args
    assert args[args.index("--analysis-scheduler") + 1] == SCHEDULER, args
    with capsys.disabled():
        print(f"\n[dask] helm upgrade to dask.enabled=true until the new operators were Ready: "
              f"{dask_release['upgrade_s']:.1f}s")


@pytest.fixture(scope="module")
def first_capture(trainer, api) -> dict:
    ns, _ = trainer
    done = wait_converged(api, start_capture(api, ns, 1500))
    assert done["phase"] == "converged" and done["counts"] == {"archived": 2}, json.dumps(done)[:3000]
    return _analysed(api, done["capture_id"])


def test_a_capture_is_analysed_rank_by_rank_on_the_dask_workers(trainer, api, s3, first_capture, capsys):
    from kubernetes import client
    ns, _ = trainer
    status, cid = first_capture, first_capture["capture_id"]
    analysis = status["analysis"]
    assert analysis["state"] == "done" and analysis.get("exit_code") == 0, json.dumps(status)[:3000]
    job = client.BatchV1Api(api.api_client).read_namespaced_job(analysis["job"], ns)
    args = job.spec.template.spec.containers[0].args
    assert args[args.index("--scheduler") + 1] == SCHEDULER, args
    pod = _job_pod(api, ns, analysis["job"])
    log = pod_log(api, ns, pod.metadata.name, "analyze")
    # the driver reached the chart's cluster and started none of its own
    (connected,) = _events(log, "dask.connected")
    assert connected["scheduler"] == SCHEDULER and connected["workers"] == "2", connected
    assert not _events(log, "dask.started"), log[-3000:]

    # Each rank ran on a worker pod, not in the Job's pod: its summary (next to its trace) names the host.
    workers = {p.metadata.name for p in api.list_namespaced_pod(NS, label_selector=WORKER_SEL).items}
    ranks = _rank_summaries(s3, status["manifest_uri"])
    assert sorted(ranks) == [0, 1]
    for rank, rs in ranks.items():
        assert rs["status"] == "analysed", (rank, rs["reason"], rs["detail"])
        assert rs["worker"]["host"] in workers, (rank, rs["worker"], workers, pod.metadata.name)
    assert {e["rank"] for e in _events(log, "rank.mapped")} == {"0", "1"}, log[-3000:]

    # summary.json and the report say so: the chart's scheduler, two workers, each rank's worker pod
    summary = _s3_json(s3, status["report_uri"].replace("report.html", "summary.json"))
    assert summary["capture"]["capture_id"] == cid and summary["status"] == "analysed"
    assert summary["counts"]["analysed"] == 2, summary["counts"]
    assert summary["analysed_on"] == {"scheduler": SCHEDULER, "workers": 2}, summary.get("analysed_on")
    assert {r["rank"]: r["worker"] for r in summary["ranks"]} == {r: rs["worker"]["host"] for r, rs in ranks.items()}
    report = status["report_uri"]
    bucket, _, key = report.removeprefix("s3://").partition("/")
    page = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert cid in page and f"Ranks analysed on the Dask cluster {SCHEDULER} (2 workers)" in page
    assert report in log.splitlines()

    wall = _log_seconds(log, "manifest.read", "analysis.written")
    job_s = (job.status.completion_time - job.status.start_time).total_seconds()
    rank_s = {r: round(sum(rs["seconds"].values()), 1) for r, rs in ranks.items()}
    with capsys.disabled():
        print(f"\n[dask] capture {cid}: analysis (manifest read -> report written) {wall:.1f}s, Job start -> complete "
              f"{job_s:.0f}s, per rank on its worker {rank_s}, trace bytes "
              f"{[a['size'] for a in _s3_json(s3, status['manifest_uri'])['artifacts']]}")


def test_a_worker_pod_deleted_mid_analysis_costs_a_retry_of_its_rank(trainer, api, s3, first_capture, capsys):
    """Deleted once it has fetched a rank of this capture (it is analysing it): the scheduler
    hands that rank to another worker and the analysis completes with every rank analysed, or the
    lost rank is `unanalysable` with the reason and the rest analysed; the report is written."""
    ns, _ = trainer
    done = wait_converged(api, start_capture(api, ns, LONG_CAPTURE_MS))
    assert done["phase"] == "converged" and done["counts"] == {"archived": 2}, json.dumps(done)[:3000]
    cid = done["capture_id"]

    def fetching():
        """(worker pod, rank) once a worker logged its fetch of a rank of this capture; (None,
        None) when the analysis ended without any worker fetching one."""
        finished = capture_status(api, cid).get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled")
        for p in api.list_namespaced_pod(NS, label_selector=WORKER_SEL).items:
            if p.metadata.deletion_timestamp or p.status.phase != "Running":
                continue
            for e in _events(pod_log(api, NS, p.metadata.name), "artifact.fetched"):
                if e.get("capture_id") == cid:
                    return p, int(e["rank"])
        return (None, None) if finished else None
    victim, rank = wait_until("a worker analysing a rank of the capture", fetching, 300, 0.2)
    assert victim is not None, f"capture {cid}'s analysis ended with no rank on a Dask worker: {capture_status(api, cid)}"
    t_del = time.monotonic()
    api.delete_namespaced_pod(victim.metadata.name, NS, grace_period_seconds=0)

    status = _analysed(api, cid)
    analysis = status["analysis"]
    assert analysis["state"] == "done" and analysis.get("exit_code") == 0, json.dumps(status)[:3000]
    summary = _s3_json(s3, status["report_uri"].replace("report.html", "summary.json"))
    assert summary["status"] == "analysed" and summary["capture"]["capture_id"] == cid
    rows = {r["rank"]: r for r in summary["ranks"]}
    assert sorted(rows) == [0, 1]
    for r, row in rows.items():
        assert row["status"] == "analysed" or (row["status"], row["reason"]) == ("excluded", "unanalysable"), row
        if row["reason"] == "unanalysable":
            assert "worker" in row["detail"] and "died" in row["detail"], row
    ranks = _rank_summaries(s3, status["manifest_uri"])
    assert [r for r, row in rows.items() if row["status"] == "analysed"], "no rank analysed"
    assert summary["analysed_on"]["scheduler"] == SCHEDULER, summary.get("analysed_on")
    if rows[rank]["status"] == "analysed":
        # the retry: the rank the deleted pod had fetched was analysed (again) on another worker
        assert rows[rank]["worker"] == ranks[rank]["worker"]["host"], (rows[rank], ranks.get(rank))
        assert rows[rank]["worker"] != victim.metadata.name, (
            f"rank {rank} finished on {victim.metadata.name} before the deletion landed", ranks[rank]["worker"])
    pod = _job_pod(api, ns, analysis["job"])
    log = pod_log(api, ns, pod.metadata.name, "analyze")
    assert status["report_uri"] in log.splitlines(), log[-3000:]
    # The Deployment replaced the pod; the cluster is two workers again.
    wait_until("two workers Ready again", lambda: len(_ready(
        api.list_namespaced_pod(NS, label_selector=WORKER_SEL).items)) == 2, 300, 1)
    with capsys.disabled():
        print(f"\n[dask] capture {cid}: worker {victim.metadata.name} deleted analysing rank {rank}; analysis done "
              f"{time.monotonic() - t_del:.1f}s after the deletion; rank {rank}: {rows[rank]['status']} "
              f"{rows[rank]['reason'] or ''} on {rows[rank].get('worker')}; "
              f"per rank seconds {json.dumps({r: rs['seconds'] for r, rs in ranks.items()})}, trace bytes "
              f"{[a['size'] for a in _s3_json(s3, status['manifest_uri'])['artifacts']]}")
