"""The cluster tests' real cluster: brought up once for the tests under tests/cluster and taken
down when the last of them ends (package scope: the tests after them must not share the machine
with a control plane, Prometheus and trainers they do not use).

Needs root (network, cgroups, containerd). Off CI a machine that cannot run it skips these tests;
under CI=true that is a failure (the cluster is a required real component)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from .harness import (BB, KUBECONFIG, NS, RELEASE, REPO, TOOLBOX, MachineState, cluster_sh, down,
                      machine_state, readme_install, up, wait_until)
from .workload import gateway, torch_site

#: The node's address on the pod bridge: pods reach the host there (the apiserver, DNS, and the
#: tests' S3 server).
NODE_IP = "10.244.0.1"
S3_BUCKET = "gpulens-cluster"
S3_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
#: The Grafana service-account token the README's install puts in the chart's tokens Secret.
GRAFANA_TOKEN = "glsa_gpulens-cluster-test"


@dataclass
class Cluster:
    kubeconfig: str
    before: MachineState       # the machine before `up`: what `down` must restore
    up_s: float


#: Development only: `GPULENS_CLUSTER_REUSE=1` keeps the cluster (and the release) between pytest
#: sessions: a Ready cluster is used as it is and left running. Never under CI, and never with
#: test_1_node/test_9_teardown, which check `down` against the machine as it was before `up`.
REUSE = os.environ.get("GPULENS_CLUSTER_REUSE") == "1" and os.environ.get("CI") != "true"


@pytest.fixture(scope="package")
def cluster() -> Cluster:
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the cluster tests need root (CI runs as root)")
        pytest.skip("the cluster tests need root")
    if REUSE:
        before = machine_state()
        up_s = 0.0 if cluster_sh("status").returncode == 0 else up()
        yield Cluster(str(KUBECONFIG), before, up_s)
        return
    down()                      # leftovers of an interrupted run would poison the baseline
    before = machine_state()
    try:
        up_s = up()
    except Exception:
        down()
        raise
    yield Cluster(str(KUBECONFIG), before, up_s)
    down()


@pytest.fixture(scope="package")
def api(cluster: Cluster):
    from kubernetes import client, config
    return client.CoreV1Api(config.new_client_from_config(config_file=cluster.kubeconfig))


def load_toolbox(tmp_dir: Path) -> str:
    """A busybox image built from Debian's busybox-static (no registry here), loaded into every node."""
    out = tmp_dir / "toolbox.tar"
    subprocess.run([sys.executable, str(REPO / "cluster" / "oci_image.py"), "--ref", TOOLBOX, "--out", str(out),
                    "--entrypoint", BB, f"{BB}:bin/busybox"], check=True, capture_output=True)
    r = cluster_sh("load", str(out))
    assert r.returncode == 0, r.stderr
    return TOOLBOX


def load_gpulens_image(tmp_dir: Path) -> str:
    """The image/ room's image, built (cached by its context hash) and imported into every node,
    with its child `own_pythonpath_image(name)` in the same archive (their layers stored once)."""
    if not (REPO / "image" / "build.sh").exists():
        pytest.fail("image/build.sh is missing: the cluster runs the image from the image room")
    r = subprocess.run(["bash", str(REPO / "image" / "build.sh")], capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-6000:]
    name = r.stdout.strip().splitlines()[-1]
    child = own_pythonpath_image(name)
    (tmp_dir / "Containerfile").write_text(f"FROM {name}\nENV PYTHONPATH={torch_site()}\n")
    b = subprocess.run(["bash", str(REPO / "image" / "podman"), "build", "--pull=never", "-q", "-t", child,
                        "-f", str(tmp_dir / "Containerfile"), str(tmp_dir)], capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr
    tar = tmp_dir / "gpulens.tar"
    s = subprocess.run(["bash", str(REPO / "image" / "podman"), "save", "-m", "-o", str(tar), name, child],
                       capture_output=True, text=True, timeout=900)
    assert s.returncode == 0, s.stderr
    r = cluster_sh("load", str(tar), timeout=900)
    assert r.returncode == 0, r.stderr
    tar.unlink()
    return name


def own_pythonpath_image(gpulens_image: str) -> str:
    """A trainer image of someone else's shape: the gpulens image with `ENV PYTHONPATH` naming the
    folder torch is imported from (this machine's venv, mounted by trainer_job at the same path),
    so its trainer imports torch only if that image's PYTHONPATH survives arming (issue 43)."""
    return f"localhost/trainer-own-pythonpath:{gpulens_image.rpartition(':')[2]}"


@pytest.fixture(scope="package")
def toolbox(cluster, tmp_path_factory) -> str:
    return load_toolbox(tmp_path_factory.mktemp("toolbox"))


@pytest.fixture(scope="package")
def gpulens_image(cluster, tmp_path_factory) -> str:
    return load_gpulens_image(tmp_path_factory.mktemp("image"))


@dataclass
class S3:
    endpoint: str       # as pods reach it
    bucket: str

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_CREDS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_CREDS["AWS_SECRET_ACCESS_KEY"],
                            region_name=S3_CREDS["AWS_DEFAULT_REGION"])


@contextlib.contextmanager
def s3_server():
    """A moto S3 server (a real S3 wire protocol server) on the node's bridge address, where the
    agent and coordinator pods reach it, with the tests' bucket."""
    from tests.conftest import free_port
    from tests.s3server import stop_process
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", NODE_IP, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = S3(f"http://{NODE_IP}:{port}", S3_BUCKET)
    try:
        wait_until("moto S3 server", lambda: proc.poll() is None and store.client().list_buckets(), 60, 0.2)
        store.client().create_bucket(Bucket=S3_BUCKET)
        yield store
    finally:
        stop_process(proc)


@pytest.fixture(scope="package")
def s3(cluster):
    """The archive of the loop tests."""
    with s3_server() as store:
        yield store


class Grafana:
    """tests/doubles/grafana_double.py (Grafana's annotations HTTP API, checking the service-account
    token) served on the node's bridge address in a thread of its own, where coordinator pods reach it.
    Tests read it through the same API (`search`), never the double's dicts across threads."""

    def __init__(self, token: str):
        self.token, self.url = token, ""
        self._loop = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="grafana-double", daemon=True)

    def _serve(self) -> None:
        import asyncio
        from aiohttp import web
        from tests.doubles.grafana_double import GrafanaDouble
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(GrafanaDouble(self.token).app(), access_log=None, shutdown_timeout=0.1)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, NODE_IP, 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://{NODE_IP}:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    def start(self) -> "Grafana":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Grafana double did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def search(self, *tags: str) -> list[dict]:
        """`GET /api/annotations?tags=...` (tags ANDed), with the token."""
        import json
        import urllib.parse
        import urllib.request
        query = urllib.parse.urlencode([("tags", t) for t in tags] + [("limit", "100")])
        req = urllib.request.Request(f"{self.url}/api/annotations?{query}",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())


@contextlib.contextmanager
def grafana_server():
    server = Grafana(GRAFANA_TOKEN).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package")
def grafana(cluster):
    """The annotations target of the coordinators (the README's `grafana.url`)."""
    with grafana_server() as server:
        yield server


@pytest.fixture(scope="package")
def release(cluster, api, gpulens_image, s3, grafana, tmp_path_factory):
    """The chart installed once for the cluster tests by the README's own lines (values file, kubectl and
    helm commands: tests/cluster/readme_install.py), archiving to the S3 server and annotating the
    Grafana double.

    Not uninstalled: the cluster's `down` (test_9, then the session's end) takes every object with
    it, and test_9 checks `down` with the release running."""
    install = readme_install(gpulens_image, s3.endpoint, grafana.url)
    out = install.run(cluster.kubeconfig, REPO, tmp_path_factory.mktemp("readme-install"), rerun=REUSE)
    if REUSE:
        restart_release_pods(api)
    return out


def restart_release_pods(api) -> None:
    """A kept cluster's pods may run another worktree's image under the same tag (an upgrade
    restarts only pods whose spec changed): start every release pod again from the loaded image."""
    from .harness import NS
    old = {p.metadata.uid for p in api.list_namespaced_pod(NS).items}
    api.delete_collection_namespaced_pod(NS, grace_period_seconds=0)

    def fresh_and_ready():
        pods = api.list_namespaced_pod(NS).items
        return pods and all(p.metadata.uid not in old and p.status.container_statuses
                            and all(c.ready for c in p.status.container_statuses) for p in pods)
    wait_until("the release's pods restarted and Ready", fresh_and_ready, 300, 1)


# --- Prometheus and Alertmanager outside the cluster (cluster/monitoring.py; test_5_alerts) --------

#: Alerts with this label go to a receiver holding a wrong gateway token (the 401 check).
WRONG_TOKEN_LABEL = ("gpulens_test_receiver", "wrong-token")


@dataclass
class Monitor:
    prometheus: str                 # http://127.0.0.1:<port>
    alertmanager: str
    logs: dict[str, Path]           # process name -> its log file
    gateway_url: str
    gateway_token: str

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def get(self, url: str, **params) -> dict:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(url + q, timeout=10) as r:
            return json.loads(r.read())

    def query(self, expr: str) -> list[dict]:
        """Prometheus's instant result for `expr`."""
        body = self.get(f"{self.prometheus}/api/v1/query", query=expr)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def firing(self, alertname: str, namespace: str) -> list[dict]:
        """Prometheus's firing `alertname` alerts for pods of `namespace`."""
        return [a for a in self.get(f"{self.prometheus}/api/v1/alerts")["data"]["alerts"]
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"
                and a["labels"].get("namespace") == namespace]


def _service_account_secret(api, namespace: str, name: str) -> dict[str, str]:
    """The token Secret 1.20's token controller makes for a ServiceAccount (decoded)."""
    import base64

    def made():
        for ref in api.read_namespaced_service_account(name, namespace).secrets or []:
            s = api.read_namespaced_secret(ref.name, namespace)
            if s.type == "kubernetes.io/service-account-token" and s.data and "token" in s.data:
                return {k: base64.b64decode(v).decode() for k, v in s.data.items()}
        return None
    return wait_until(f"the token Secret of ServiceAccount {namespace}/{name}", made, 60)


def _apply_rbac(api, docs: list[dict]) -> None:
    from kubernetes import utils
    from kubernetes.client.rest import ApiException
    for doc in docs:
        try:
            utils.create_from_dict(api.api_client, doc)
        except utils.FailToCreateError as e:       # kept from an earlier session (REUSE): as it is
            if not all(isinstance(x, ApiException) and x.status == 409 for x in e.api_exceptions):
                raise


def _start(name: str, argv: list[str], log: Path, ready: str) -> subprocess.Popen:
    out = log.open("wb")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()

    def up():
        assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        import urllib.request
        with urllib.request.urlopen(ready, timeout=2) as r:
            return r.status == 200
    wait_until(f"{name} ready", up, 60, 0.3)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """The whole process group, TERM then KILL."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def monitoring_of(api, d: Path) -> Iterator[Monitor]:
    """Debian's prometheus and prometheus-alertmanager on 127.0.0.1 for the cluster `api` talks to,
    configured by cluster/monitoring.py as a chart user without the Operator would: pod discovery
    as a read-only ServiceAccount (through cluster/pod_sd.py: Debian's build has no Kubernetes
    discovery), the project's rules time-scaled like `gpulens up`, the gateway Service as the
    webhook receiver. Plus one test-only route: alerts labelled WRONG_TOKEN_LABEL go to the same URL
    with a wrong token. Logs stay in `d`; a failing test that used this shows their tails."""
    from tests.conftest import free_port
    sys.path.insert(0, str(REPO / "cluster"))
    import monitoring as mon

    prom_bin, am_bin = "/usr/bin/prometheus", "/usr/bin/prometheus-alertmanager"
    for b in (prom_bin, am_bin):
        if not Path(b).exists():
            if os.environ.get("CI") == "true":
                pytest.fail(f"{b} is missing (scripts/setup.sh installs it)")
            pytest.skip(f"{b} is missing")
    _apply_rbac(api, mon.rbac())
    sa = _service_account_secret(api, mon.SA_NAMESPACE, mon.SA_NAME)
    (d / "sa-token").write_text(sa["token"])
    (d / "ca.crt").write_text(sa["ca.crt"])
    base, token = gateway(api)
    (d / "gateway-token").write_text(token)
    (d / "wrong-token").write_text("not-the-gateway-token")
    sd_port, am_port, prom_port = free_port(), free_port(), free_port()
    m = mon.Monitoring(token_file=d / "sa-token", ca_file=d / "ca.crt", gateway_url=base,
                       gateway_token_file=d / "gateway-token", alertmanager=f"127.0.0.1:{am_port}",
                       rule_files=mon.write_rules(d / "rules"), api_server=f"https://{NODE_IP}:6443",
                       namespaces=(NS,), release=RELEASE, pod_sd_url=f"http://127.0.0.1:{sd_port}")
    prom_cfg, am_cfg = mon.write_configs(d, m)
    am = yaml.safe_load(am_cfg.read_text())
    key, value = WRONG_TOKEN_LABEL
    am["route"]["routes"].insert(0, {"receiver": "gateway-wrong-token", "matchers": [f'{key}="{value}"'], "continue": False})
    am["receivers"].append({"name": "gateway-wrong-token", "webhook_configs": [{
        "url": base + mon.WEBHOOK_PATH, "send_resolved": False,
        "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(d / "wrong-token")}}}]})
    am_cfg.write_text(yaml.safe_dump(am, sort_keys=False))
    logs = {n: d / f"{n}.log" for n in ("pod-sd", "alertmanager", "prometheus")}
    procs = []
    try:
        procs.append(_start("pod-sd", [sys.executable, str(REPO / "cluster" / "pod_sd.py"), "--listen",
                                       f"127.0.0.1:{sd_port}", "--api-server", m.api_server, "--token-file",
                                       str(m.token_file), "--ca-file", str(m.ca_file)],
                            logs["pod-sd"], f"http://127.0.0.1:{sd_port}/healthz"))
        procs.append(_start("alertmanager", [am_bin, f"--config.file={am_cfg}", f"--storage.path={d / 'am-data'}",
                                             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                            logs["alertmanager"], f"http://127.0.0.1:{am_port}/-/ready"))
        procs.append(_start("prometheus", [prom_bin, f"--config.file={prom_cfg}", f"--storage.tsdb.path={d / 'prom-data'}",
                                           f"--web.listen-address=127.0.0.1:{prom_port}"],
                            logs["prometheus"], f"http://127.0.0.1:{prom_port}/-/ready"))
        yield Monitor(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", logs, base, token)
    finally:
        for p in reversed(procs):
            _stop(p)


@pytest.fixture(scope="package")
def monitoring(cluster, api, release, tmp_path_factory) -> Monitor:
    """Prometheus and Alertmanager for the package's one-node cluster (monitoring_of)."""
    with monitoring_of(api, tmp_path_factory.mktemp("monitoring")) as m:
        yield m


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used the monitoring processes gets the tails of their logs."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    for mon in getattr(item, "funcargs", {}).values():
        if isinstance(mon, Monitor):
            for name, path in mon.logs.items():
                if path.exists():
                    rep.sections.append((f"{name} log (tail)", path.read_text(errors="replace")[-4000:]))
