"""The workloads the cluster tests run and the gateway they ask for captures: one builder each, so
the loop (test_3), the faults (test_4) and the churn (test_6) run the same trainer.

The trainer runs the gpulens image's python3 (bookworm + python3 + bcc + gpulens, no torch), with
the demo trainer as the image installed it (image/build.sh rebuilds it whenever the sources change):
torch comes from this machine's venv, hostPath read-only (no registry here to pull a torch image
from); it drives the CUDA driver stand-in
(exporter/stub, also by hostPath), so the exporter's uprobes count its launches."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .harness import NS, STATE, wait_until

JOB = "trainer"
#: the trainer container's CPU request (Burstable QoS; see trainer_job)
TRAINER_CPU_REQUEST = "250m"
#: Exits 1 when the pod's attempt (GPULENS_ATTEMPT, from the webhook's `gpulens.dev/attempt` label)
#: is 0, else runs the trainer: the first pod of a Job fails, its replacement trains.
FAIL_ATTEMPT_0 = 'if [ "${GPULENS_ATTEMPT:-0}" = 0 ]; then echo "attempt 0: failing on purpose"; exit 1; fi; exec "$@"'


def armed_namespace(api) -> str:
    """A fresh namespace opted in to arming."""
    from kubernetes import client
    ns = f"ml-{uuid.uuid4().hex[:6]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={"gpulens.dev/arming": "enabled"})))
    return ns


def torch_site() -> str:
    import torch
    return str(Path(torch.__file__).parents[1])


def trainer_job(image: str, *, fail_attempt_0: bool = False, backoff_limit: int = 0,
                control_dir: str | None = None, nodes: int = 1, image_pythonpath: bool = False,
                lost_node_after_s: int | None = None, trainer_args: tuple[str, ...] = (),
                stub_gpu: str | None = None) -> dict:
    """Job `trainer`: one pod, torchrun with two workers of the demo trainer (each steps forever).

    `fail_attempt_0`: the container first runs FAIL_ATTEMPT_0 (with `backoff_limit` >= 1 the Job
    controller replaces the failed pod). `control_dir`: a host folder mounted at /control whose
    `incident` file the trainer reads (a test writes it to induce an incident); None: a pod-local
    path nobody writes. `nodes` > 1: that many pods of the Job, one per node (required
    anti-affinity), one torchrun world of 2 x `nodes` ranks found through the PEERS Service
    (trainer_peers_service; FIND_PEERS), its gloo all-reduce crossing the nodes every step.
    `image_pythonpath`: the pod sets no PYTHONPATH; `image` must name torch's folder in its own
    `ENV PYTHONPATH` (conftest.own_pythonpath_image). `lost_node_after_s`: the pods tolerate an
    unreachable or not-ready node that long, then Kubernetes evicts them (its default is 300 s;
    training jobs set less, so that a lost node's pod is replaced instead of waited for).
    `trainer_args`: more arguments of the demo trainer (e.g. `--hang-rank 3 --hang-at-step 100`).
    `stub_gpu`: the node folder of the release's `exporter.nvml: stub:<folder>`: the workers publish
    their stand-in GPU contexts there (GPULENS_STUB_STATE_DIR), so the exporter's NVML view lists
    them, as NVML lists a real job's processes (the stalled alert needs that); both workers of a pod
    then share one stand-in GPU's timeline."""
    from gpulens.exporter.stub import build_stub
    libcuda = build_stub(STATE / "stub").libcuda
    site = torch_site()
    mounts = [("site", site), ("stub", str(libcuda.parents[1]))]
    mount_paths = {}
    if control_dir:
        mounts.append(("control", control_dir))
        mount_paths["control"] = "/control"
    command = ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29500", *(
               [f"--nnodes={nodes}", "--node-rank=$1", "--master-addr=$2"] if nodes > 1 else []),
               "-m", "gpulens.up.demo_trainer", "--libcuda", str(libcuda),
               "--control", "/control/incident" if control_dir else "/tmp/incident",
               "--kernels", "10", "--h2d-bytes", "65536", "--copy-floats", "1024",
               # the in-cluster alert tests were measured with this (the demo's default is now 128 MiB)
               "--sync-copy-bytes", str(64 << 20), *trainer_args]
    env = []
    if nodes > 1:   # a shell script, as users write them: the webhook reads --nproc-per-node in it
        command = ["sh", "-c", 'set -e; PEERS=$(python3 -c "$FIND_PEERS"); set -- $PEERS; exec ' + " ".join(command)]
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
               {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
               {"name": "NNODES", "value": str(nodes)}, {"name": "FIND_PEERS", "value": FIND_PEERS},
               {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
               # Kineto's INFO lines (the tick that activated a config, or why it did not start): what
               # a warm-up refusal on these pods is read from (test_two_node.py's _kineto_said)
               {"name": "KINETO_LOG_LEVEL", "value": "0"}]
    if stub_gpu:
        env.append({"name": "GPULENS_STUB_STATE_DIR", "value": stub_gpu})
    if fail_attempt_0:
        command = ["sh", "-c", FAIL_ATTEMPT_0, "sh", *command]
    spread = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"job-name": JOB}}, "topologyKey": "kubernetes.io/hostname"}]}}}
    tolerate = {"tolerations": [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
                                 "tolerationSeconds": lost_node_after_s} for t in ("unreachable", "not-ready")]}
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": JOB},
        "spec": {"backoffLimit": backoff_limit, "parallelism": nodes, "completions": nodes, "template": {"spec": {
            **(spread if nodes > 1 else {}), **(tolerate if lost_node_after_s is not None else {}),
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "trainer", "image": image, "imagePullPolicy": "Never", "command": command,
                "env": [*([] if image_pythonpath else [{"name": "PYTHONPATH", "value": site}]),
                        {"name": "LD_LIBRARY_PATH", "value": str(libcuda.parent)},
                        {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "HOME", "value": "/tmp"}, *env],
                "securityContext": {"runAsUser": 0},
                # A CPU request, as every real training pod has: without one the pod is BestEffort,
                # whose cgroup gets cpu.shares=2 against the host's 1024, so whenever anything else
                # on the 2-core node is busy each wake-up waits long and the blocked share goes to
                # ~0.5 per rank at baseline (a clean-clone run: 1.05 for two ranks, against 0.086
                # quiet), leaving host_sync no room to show.
                "resources": {"requests": {"cpu": TRAINER_CPU_REQUEST}},
                "volumeMounts": [{"name": n, "mountPath": mount_paths.get(n, p), "readOnly": True} for n, p in mounts]
                                + ([{"name": "stub-gpu", "mountPath": stub_gpu}] if stub_gpu else [])}],
            "volumes": [{"name": n, "hostPath": {"path": p, "type": "Directory"}} for n, p in mounts]
                       + ([{"name": "stub-gpu", "hostPath": {"path": stub_gpu, "type": "DirectoryOrCreate"}}]
                          if stub_gpu else [])}}}}


#: The headless Service a multi-node trainer's pods find each other by (its endpoints: their IPs).
PEERS = f"{JOB}-peers"
#: Run by each pod of a multi-node trainer before torchrun: waits until the PEERS Service lists
#: NNODES live addresses, its own among them, and prints its node rank (its place in the sorted
#: list) and the master address (the first), which every pod computes alike: torchrun's static
#: rendezvous without an indexed Job (Kubernetes 1.20 has none) or an operator. Live: the address
#: answers on the rendezvous port, a refusal included (a pod still finding its peers listens on
#: nothing). Kubernetes 1.20 lists a Failed pod's address in a Service that publishes not-ready
#: addresses, and a lost node's pod's until its kubelet is back: counted, they made the Job's
#: replacements after a lost node (test_two_node) wait for a third peer, or one take a dead pod
#: for its master.
FIND_PEERS = """
import os, socket, sys, time
me, n = os.environ["POD_IP"], int(os.environ["NNODES"])
host = "%s.%s.svc.cluster.local" % ("PEERS", os.environ["POD_NAMESPACE"])

def alive(ip):
    s = socket.socket()
    s.settimeout(1.5)
    try:
        s.connect((ip, 29500))
        return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()

for _ in range(1200):
    try:
        ips = sorted({a[4][0] for a in socket.getaddrinfo(host, None, socket.AF_INET)})
    except OSError:
        ips = []
    ips = [ip for ip in ips if ip == me or alive(ip)]
    if len(ips) == n and me in ips:
        print(ips.index(me), ips[0])
        sys.exit(0)
    time.sleep(0.5)
sys.exit("find-peers: %s never listed %d addresses with %s" % (host, n, me))
""".replace("PEERS", PEERS)


def trainer_peers_service() -> dict:
    """The headless Service of FIND_PEERS (not-ready addresses too: a pod is found as it starts)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": PEERS},
            "spec": {"clusterIP": "None", "selector": {"job-name": JOB}, "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": 29500}]}}


def wait_training(api, ns: str, name: str):
    """Pod `name` Running with both workers stepping (each prints one "demo-trainer rank=" line)."""
    def running():
        p = api.read_namespaced_pod(name, ns)
        assert p.status.phase not in ("Failed", "Succeeded"), api.read_namespaced_pod_log(name, ns)[-4000:]
        return p.status.phase == "Running" and p
    wait_until(f"trainer pod {name} Running", running, 300)
    wait_until(f"both workers of {name} started", lambda: running() and api.read_namespaced_pod_log(
        name, ns, container="trainer").count("demo-trainer rank=") >= 2, 300, 1)
    return api.read_namespaced_pod(name, ns)


def start_trainer(api, ns: str, image: str, control_dir: str | None = None, image_pythonpath: bool = False):
    """Job `trainer` in `ns`, its pod training; returns the pod."""
    from kubernetes import client
    client.BatchV1Api(api.api_client).create_namespaced_job(ns, trainer_job(image, control_dir=control_dir,
                                                                            image_pythonpath=image_pythonpath))
    pod = wait_until("trainer pod", lambda: api.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items, 60)[0]
    pod = wait_training(api, ns, pod.metadata.name)
    # BestEffort would starve it whenever the node is busy (trainer_job): the alert tests need this
    assert pod.status.qos_class == "Burstable", pod.status.qos_class
    return pod


def gateway(api) -> tuple[str, str]:
    """The gateway Service's URL (from this machine: the cluster IP) and its bearer token."""
    (svc,) = [s for s in api.list_namespaced_service(NS).items
              if (s.metadata.labels or {}).get("app.kubernetes.io/component") == "gateway"]
    secret = next(s for s in api.list_namespaced_secret(NS).items if s.data and "gateway" in s.data)
    return f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}", base64.b64decode(secret.data["gateway"]).decode()


def call(url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def start_capture(api, ns: str, duration_ms: int, timeout: float = 240) -> str:
    """A capture of job `trainer` asked of the gateway; retried while the job's coordinator is not
    ready yet (it learns the workers from the API and the agent). Returns its id."""
    base, token = gateway(api)
    started = wait_until("capture accepted by the gateway", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
        call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": duration_ms})), timeout, 2)
    return started["capture_id"]


def capture_status(api, capture_id: str) -> dict:
    base, token = gateway(api)
    return call(f"{base}/v1/captures/{capture_id}", token)[1]


def wait_converged(api, capture_id: str, timeout: float = 300) -> dict:
    """The capture's status once it is done (converged or failed): it must never stay open."""
    return wait_until(f"capture {capture_id} converged", lambda: (
        lambda s: s.get("phase") in ("converged", "failed") and s)(capture_status(api, capture_id)), timeout, 1)


def read_manifest(s3, uri: str) -> dict:
    assert uri.startswith(f"s3://{s3.bucket}/"), uri
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return json.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def archived_size(s3, uri: str) -> int:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return s3.client().head_object(Bucket=bucket, Key=key)["ContentLength"]
