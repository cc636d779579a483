"""Driving the real test cluster (cluster/cluster.sh) from tests: up/down, the admin API client,
and the machine state that `down` must give back."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cluster.sh"
STATE = Path("/var/lib/gpulens-cluster")
RUN = Path("/run/gpulens-cluster")
KUBECONFIG = STATE / "admin.kubeconfig"
PKI = STATE / "pki"
BRIDGE = "gl-cni0"
NODE = "gpulens-node"
#: The second node of `cluster.sh up --nodes 2` (its own network, mount and PID namespaces) and its
#: address; node k's pods are 10.244.(k-1).0/24 (cluster/cluster.sh).
NODE2, NODE2_IP = "gpulens-node-2", "10.244.1.1"
#: cluster.sh reads the node count from this variable (default 1).
NODES_ENV = "GPULENS_CLUSTER_NODES"
TOOLBOX = "localhost/gpulens-toolbox:1"      # conftest builds it from Debian's busybox-static
BB = "/bin/busybox"
#: The chart's release and namespace on the test cluster: the README's install lines say the same
#: (test_units checks it).
RELEASE, NS = "gl", "gpulens-system"
CHART = REPO / "helm" / "gpulens"
#: The sysctls the cluster changes (kubelet, kube-proxy, bridge netfilter); the same list as cluster.sh.
SYSCTLS = ("net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
           "net.ipv4.conf.all.route_localnet", "vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops",
           "net.netfilter.nf_conntrack_max", "net.netfilter.nf_conntrack_tcp_timeout_established",
           "net.netfilter.nf_conntrack_tcp_timeout_close_wait", "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
#: A cold `up` compiles Kubernetes (~10 min on 2 busy cores); generous but bounded.
UP_TIMEOUT_S = 45 * 60

T = TypeVar("T")


def cluster_sh(*args: str, timeout: float = 300, nodes: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({NODES_ENV: str(nodes)} if nodes is not None else {}))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def node_count() -> int:
    """The nodes of the cluster that is up (or was last brought up): 0 when none is."""
    try:
        return int((RUN / "node-count").read_text())
    except (OSError, ValueError):
        return 0


def readme_install(image: str, s3_endpoint: str, grafana_url: str):
    """The README's test-cluster install (values and commands) for this image, S3 server and Grafana."""
    from .readme_install import Install, ReadmeError
    repo, _, tag = image.rpartition(":")
    install = Install.from_readme(REPO / "README.md", {"VERSION": tag, "S3_PORT": s3_endpoint.rsplit(":", 1)[1],
                                                       "GRAFANA_PORT": grafana_url.rsplit(":", 1)[1]})
    if (install.values.get("grafana") or {}).get("url") != grafana_url:
        raise ReadmeError(f"the README's grafana.url {(install.values.get('grafana') or {}).get('url')} "
                          f"is not {grafana_url}")
    if install.values["image"]["repository"] != repo:
        raise ReadmeError(f"the README installs {install.values['image']['repository']}, the image is {repo}")
    if install.values["archive"]["s3Endpoint"] != s3_endpoint:
        raise ReadmeError(f"the README's s3Endpoint {install.values['archive']['s3Endpoint']} is not {s3_endpoint}")
    return install


def _admission_race(line: str) -> bool:
    """The operator's retry of a coordinator Pod that Kubernetes 1.20's ServiceAccount admission
    refused because the new account was not there yet ("error looking up service account"): not an
    RBAC refusal, and retried until it lands (issue 31). Anything else with a 403 still counts."""
    return "event.retry" in line and "error looking up service account" in line


def forbidden_in_logs(api, namespace: str) -> dict[str, list[str]]:
    """Every log line of every container of `namespace`'s pods that reports a 403 or Forbidden."""
    out = {}
    for p in api.list_namespaced_pod(namespace).items:
        # A container still waiting to start has no log yet (the API answers 400): nothing in it.
        started = {s.name for s in p.status.container_statuses or [] if s.state and (s.state.running or s.state.terminated)}
        for c in p.spec.containers:
            if c.name not in started:
                continue
            log = api.read_namespaced_pod_log(p.metadata.name, namespace, container=c.name)
            bad = [line for line in log.splitlines() if (" 403" in line or "Forbidden" in line or '"403' in line)
                   and not _admission_race(line)]
            if bad:
                out[f"{namespace}/{p.metadata.name}/{c.name}"] = bad[:3]
    return out


def up(nodes: int | None = None) -> float:
    """Start the cluster (`nodes`: the node count, else the environment's); returns the wall time.
    Raises with the script's stderr on failure."""
    t0 = time.monotonic()
    r = cluster_sh("up", timeout=UP_TIMEOUT_S, nodes=nodes)
    if r.returncode != 0:
        raise RuntimeError(f"cluster.sh up failed ({r.returncode}):\n{r.stderr[-6000:]}")
    return time.monotonic() - t0


def down() -> float:
    t0 = time.monotonic()
    r = cluster_sh("down", timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"cluster.sh down failed ({r.returncode}):\n{r.stderr[-6000:]}")
    return time.monotonic() - t0


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 120, interval: float = 0.5) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` (and the last error)."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        try:
            got = probe()
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - reported if the wait fails
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")


@dataclass(frozen=True)
class MachineState:
    """What the cluster touches outside its own directories: all of it must be back after `down`."""

    sysctls: tuple[tuple[str, str], ...]
    kube_chains: frozenset[str]
    kubepods_cgroups: frozenset[str]
    mounts: frozenset[str]
    links: frozenset[str]
    processes: frozenset[str]
    state_dirs: frozenset[str]
    host_dirs: frozenset[str] = frozenset()   # the chart's default node.paths roots (issue 43: the trial's folders)


def _chains() -> set[str]:
    out = set()
    for ipt in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            r = subprocess.run([ipt, "-t", table, "-S"], capture_output=True, text=True)
            for line in r.stdout.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "-N" and parts[1].startswith("KUBE-"):
                    out.add(f"{ipt}/{table}/{parts[1]}")
                if "-j KUBE-" in line and not line.startswith("-A KUBE-"):
                    out.add(f"{ipt}/{table}/jump: {line}")
    return out


def machine_state() -> MachineState:
    sysctls = []
    for k in SYSCTLS:
        p = Path("/proc/sys") / k.replace(".", "/")
        if p.exists():
            sysctls.append((k, p.read_text().strip()))
    cgroups = {str(p) for pattern in ("*/kubepods", "*/gl-node-*") for p in Path("/sys/fs/cgroup").glob(pattern)}
    ours = re.compile(r"^(/var/lib/gpulens-cluster|/run/gpulens-cluster|/run/netns/cni-|/run/netns/gl-node-)")
    mounts = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if ours.match(line.split()[4])}
    links = {line.split(":")[1].strip().split("@")[0] for line in
             subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()}
    links = {name for name in links if name == BRIDGE or name.startswith("gl-veth-")}
    procs = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "/var/lib/gpulens-cluster/" in cmd or "/run/gpulens-cluster/" in cmd:
                procs.add(f"{p.name} {cmd.strip()}")
    dirs = {str(d) for d in (STATE, RUN) if d.exists()}
    host = {d for d in ("/var/lib/gpulens", "/run/gpulens") if Path(d).exists()}
    return MachineState(tuple(sysctls), frozenset(_chains()), frozenset(cgroups), frozenset(mounts),
                        frozenset(links), frozenset(procs), frozenset(dirs), frozenset(host))


def machine_diff(before: MachineState, after: MachineState, theirs: set[str]) -> dict:
    """What `after` changed from `before` (sysctls in `theirs`, changed by someone else while the
    cluster was up, are left out): empty when `down` gave everything back."""
    diffs = {f.name: (getattr(before, f.name), getattr(after, f.name))
             for f in dataclasses.fields(after) if f.name != "sysctls" and getattr(before, f.name) != getattr(after, f.name)}
    diffs.update({k: (v, dict(after.sysctls).get(k)) for k, v in before.sysctls
                  if k not in theirs and dict(after.sysctls).get(k) != v})
    return diffs


def sysctls_changed_by_others(during: MachineState) -> set[str]:
    """The sysctls whose value while up is not the one `up` recorded (someone else set them since)."""
    ours = dict(line.split("=", 1) for line in (RUN / "sysctls.ours").read_text().split())
    return {k for k, v in during.sysctls if ours.get(k, v) != v}


def pod_log(api, namespace: str, pod: str, container: str | None = None) -> str:
    """A pod's log as text (the client's own decoding hands back `str(bytes)`: one "b'...\\n...'" line)."""
    r = api.read_namespaced_pod_log(pod, namespace, container=container, _preload_content=False)
    return r.data.decode(errors="replace")


def pod_logs(api, namespace: str, label_selector: str, container: str | None = None) -> str:
    return "\n".join(pod_log(api, namespace, p.metadata.name, container)
                     for p in api.list_namespaced_pod(namespace, label_selector=label_selector).items)
