"""The `gpulens up` process tree: what starts, in which order, with which flags, and how it ends."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from gpulens.ground.logs import get_logger
from gpulens.hooks import hook_path

from .configs import alertmanager_config, prometheus_config, write_yaml
from .layout import Layout, Ports
from .local_operator import LocalOperator
from .page import Page
from .status import StatusReporter
from .supervisor import ChildSpec, Supervisor, http_ready

__all__ = ["Runner", "SERVING_WORKLOAD", "SERVING_REVISION", "SERVING_PODS"]

log = get_logger("up")

#: the serving demo (--serving) as a cluster would name it: Deployment demo-serve, its ReplicaSet
#: (the revision, the coordinator's job id: `<deployment>-<pod-template-hash>`) and two of its pods
SERVING_WORKLOAD = "Deployment/demo-serve"
SERVING_REVISION = "demo-serve-6d9f7c8b5"
SERVING_PODS = (f"{SERVING_REVISION}-x7k2p", f"{SERVING_REVISION}-q4m9w")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, args: argparse.Namespace, out=None):
        self.args = args
        self.out = out or sys.stdout
        self.layout = Layout.create(args.workdir)
        self.ports = Ports(args.port_base)
        self.sup = Supervisor(self.layout.logs, announce=self.announce)
        self.node = socket.gethostname()
        self.cli = [sys.executable, "-m", "gpulens.cli"]
        self.urls: dict[str, str] = {}
        self.operator: LocalOperator | None = None
        self.page: Page | None = None
        self.stub = None
        self.trainer_pod = ""
        self._demo_pids: set[int] = set()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def announce(self, text: str) -> None:
        """An event line (timestamped), as opposed to the start-up block."""
        self.say(f"[{time.strftime('%H:%M:%S')}] {text}")

    # --- the tree -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        self.say(f"gpulens up: starting in {self.layout.workdir} (logs: {self.layout.logs})")
        rc = 0
        background: list[asyncio.Task] = []
        try:
            await self._start_core()
            if self.args.demo:
                await self._start_demo()
            self._print_urls()
            status = StatusReporter(self, interval_s=self.args.status_interval)
            background.append(asyncio.create_task(status.run(), name="status"))
            background.append(asyncio.create_task(self.operator.run(), name="local-operator"))
            if self.args.incident:
                background.append(asyncio.create_task(self._induce_incident(), name="incident"))
            waiter = asyncio.create_task(stop.wait())
            timers = [waiter]
            if self.args.exit_after:
                timers.append(asyncio.create_task(asyncio.sleep(self.args.exit_after)))
            await asyncio.wait(timers, return_when=asyncio.FIRST_COMPLETED)
            for t in timers:
                t.cancel()
            self.say("gpulens up: stopping ...")
        except RuntimeError as exc:
            self.say(f"gpulens up: {exc}")
            rc = 1
        finally:
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.sup.stop_all()
            if self.page:
                await self.page.stop()
            removed = self._remove_stale_registrations()
            sockets = self._remove_socket_dir()
            self.say(f"gpulens up: stopped {len(self.sup.children)} processes"
                     + (f", removed {removed} registration records" if removed else "")
                     + (f", removed {sockets} Kineto socket folders" if sockets else "")
                     + f"; archive kept at {self.layout.archive_dir}")
        return rc

    async def _start_core(self) -> None:
        L, P, a = self.layout, self.ports, self.args
        tok = L.token_file
        await self.sup.start(ChildSpec(
            "exporter", self.cli + ["exporter", "--listen", f"127.0.0.1:{P.exporter}", "--node", self.node,
                                    "--registry-dir", str(L.registry), "--no-kubernetes",
                                    "--nvml", f"stub:{L.stub_state}" if a.demo else "auto"],
            ready=http_ready(f"http://127.0.0.1:{P.exporter}/healthz"), url=f"http://127.0.0.1:{P.exporter}/metrics"))
        await self.sup.start(ChildSpec(
            "agent", self.cli + ["agent", "--listen", f"127.0.0.1:{P.agent}", "--node", self.node,
                                 "--registry-dir", str(L.registry), "--trace-dir", str(L.traces),
                                 "--state-dir", str(L.state / "agent"), "--archive-root", L.archive_root,
                                 "--trigger", a.trigger, "--dynolog-addr", a.dynolog_addr,
                                 "--socket-dir", str(L.socket_dir), "--token-file", str(tok("agent"))],
            ready=http_ready(f"http://127.0.0.1:{P.agent}/healthz"), url=f"http://127.0.0.1:{P.agent}"))
        L.routes_file.write_text(json.dumps({}))
        await self.sup.start(ChildSpec(
            "gateway", self.cli + ["gateway", "--listen", f"127.0.0.1:{P.gateway}", "--token-file", str(tok("gateway")),
                                   "--routes-file", str(L.routes_file), "--coordinator-token-file", str(tok("coordinator")),
                                   "--state-dir", str(L.state / "gateway"), "--cooldown-s", "120",
                                   # wall-clock alert captures in the demo, like its own baseline: with ~20 ms
                                   # steps, the ranks' 5 s Kineto poll phases can span more than a 100-step round-up
                                   "--iterations", "0"],
            ready=http_ready(f"http://127.0.0.1:{P.gateway}/healthz"), url=f"http://127.0.0.1:{P.gateway}"))
        self.operator = LocalOperator(self)
        self.operator.write_scrape_targets()  # no coordinator yet: an empty list before Prometheus reads it
        self.page = Page(self, port=P.ui)
        await self.page.start()
        self.urls["captures and annotations"] = f"http://127.0.0.1:{P.ui}/"
        if not a.no_prometheus:
            await self._start_prometheus_and_alertmanager()

    def coordinator_spec(self, namespace: str, job: str, attempt: int, index: int,
                         serving: bool = False) -> ChildSpec:
        """`serving`: the job is a serving revision (its records name a Deployment): replicas, each its
        own world, captured as the alerted pod plus a healthy peer and compared with it, so the
        demo's own baseline capture is not needed there."""
        L, P, a = self.layout, self.ports, self.args
        port = P.coordinator(index)
        argv = self.cli + ["coordinator", "--listen", f"127.0.0.1:{port}", "--job", job, "--attempt", str(attempt),
                           "--namespace", namespace, "--discovery", "local", "--registry-dir", str(L.registry),
                           "--agent-url", f"http://127.0.0.1:{P.agent}", "--archive-root", L.archive_root,
                           "--token-file", str(L.token_file("coordinator")),
                           "--agent-token-file", str(L.token_file("agent")), "--analysis", "local",
                           "--state-dir", str(L.state / f"coordinator-{namespace}-{job}-{attempt}")]
        if serving:
            argv += ["--serving"]
        elif a.demo and a.incident:
            # the demo takes its healthy baseline itself, well before the incident starts
            argv += ["--baseline-after-s", f"{max(10.0, a.incident_after / 2):g}"]
        if a.grafana_url:
            argv += ["--grafana-url", a.grafana_url]
            if a.grafana_token_file:
                argv += ["--grafana-token-file", str(a.grafana_token_file)]
        else:
            # links in annotations open through the local page, which serves the archive read-only
            argv += ["--annotations-file", str(L.annotations_file),
                     "--report-base-url", f"http://127.0.0.1:{P.ui}/archive"]
        return ChildSpec(f"coordinator-{namespace}-{job}-a{attempt}", argv,
                         ready=http_ready(f"http://127.0.0.1:{port}/healthz"), url=f"http://127.0.0.1:{port}")

    async def _start_prometheus_and_alertmanager(self) -> None:
        L, P = self.layout, self.ports
        prom, am = shutil.which("prometheus"), shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        if not prom or not am:
            self.say("gpulens up: Prometheus/Alertmanager not installed (scripts/setup.sh installs them): "
                     "no alerts, captures only on request")
            return
        rules_dir = L.state / "rules"
        # runbook links open on the captures page; dashboard links only where a Grafana is configured
        gen = subprocess.run([sys.executable, "-m", "gpulens.alertrules.generate", "--time-scale", str(self.args.time_scale),
                              "--rules-out", str(rules_dir), "--manifest-out", str(L.state / "prometheusrule.yaml"),
                              "--runbook-base-url", f"http://127.0.0.1:{P.ui}/runbooks",
                              "--grafana-url", self.args.grafana_url or ""],
                             capture_output=True, text=True)
        if gen.returncode != 0:
            raise RuntimeError(f"generating alert rules failed: {gen.stderr.strip()[-500:]}")
        rule_files = sorted(rules_dir.glob("*.yml")) + sorted(rules_dir.glob("*.yaml"))
        prom_cfg = write_yaml(L.state / "prometheus.yml", prometheus_config(
            exporter=f"127.0.0.1:{P.exporter}", rule_files=rule_files, alertmanager=f"127.0.0.1:{P.alertmanager}",
            agent=f"127.0.0.1:{P.agent}", coordinators_file=L.coordinator_targets_file))
        am_cfg = write_yaml(L.state / "alertmanager.yml", alertmanager_config(
            webhook_url=f"http://127.0.0.1:{P.gateway}/v1/alertmanager", token_file=L.token_file("gateway")))
        await self.sup.start(ChildSpec(
            "alertmanager", [am, f"--config.file={am_cfg}", f"--storage.path={L.state / 'alertmanager'}",
                             f"--web.listen-address=127.0.0.1:{P.alertmanager}", "--cluster.listen-address="],
            ready=http_ready(f"http://127.0.0.1:{P.alertmanager}/-/ready"), url=f"http://127.0.0.1:{P.alertmanager}"))
        await self.sup.start(ChildSpec(
            "prometheus", [prom, f"--config.file={prom_cfg}", f"--storage.tsdb.path={L.state / 'prometheus'}",
                           f"--web.listen-address=127.0.0.1:{P.prometheus}", "--web.enable-lifecycle"],
            ready=http_ready(f"http://127.0.0.1:{P.prometheus}/-/ready"), url=f"http://127.0.0.1:{P.prometheus}"))

    #: incidents that arrive the way they do in a cluster: with a new pod of the same job (a new
    #: image, a changed CPU limit); the alert rules judge it by its workload's baseline
    NEW_POD_INCIDENTS = ("host_sync", "input_starvation")

    def _trainer_spec(self, pod: str) -> ChildSpec:
        """The demo trainer as pod `pod` of job demo/demo (its registration records name the pod)."""
        L = self.layout
        env = self.stub.env(
            PYTHONPATH=str(hook_path()), GPULENS_JOB_ID="demo", GPULENS_ATTEMPT="0", GPULENS_NAMESPACE="demo",
            GPULENS_POD_NAME=pod, GPULENS_REGISTRY_DIR=str(L.registry), GPULENS_TRACE_DIR=str(L.traces),
            GPULENS_SOCKET_DIR=str(L.socket_dir), GPULENS_STUB_STATE_DIR=str(L.stub_state), OMP_NUM_THREADS="1")
        torchrun = [sys.executable, "-m", "torch.distributed.run"]   # what the torchrun script runs, venv or not
        return ChildSpec(
            "demo-trainer", [*torchrun, "--nproc-per-node=2", f"--master-port={_free_port()}", "-m",
                  "gpulens.up.demo_trainer", "--libcuda", str(self.stub.libcuda),
                  "--control", str(L.incident_file)],
            env=env, restart=False)

    async def _start_demo(self) -> None:
        from gpulens.exporter.stub import build_stub

        L = self.layout
        self.stub = build_stub(L.workdir / "stub")
        L.incident_file.write_text("none")
        if self.args.serving:
            for device, pod in enumerate(SERVING_PODS):
                await self.sup.start(self._replica_spec(pod, device))
            return
        self.trainer_pod = "demo-trainer-0"
        await self.sup.start(self._trainer_spec(self.trainer_pod))

    def _replica_spec(self, pod: str, device: int) -> ChildSpec:
        """A replica of the serving demo as pod `pod` of Deployment demo/demo-serve, revision
        SERVING_REVISION (what its records say, as an armed serving pod's do in a cluster), on
        stand-in GPU `device`: one GPU per replica, so a neighbour on one affects only that one."""
        L = self.layout
        env = self.stub.env(
            PYTHONPATH=str(hook_path()), GPULENS_JOB_ID=SERVING_REVISION, GPULENS_ATTEMPT="0",
            GPULENS_NAMESPACE="demo", GPULENS_POD_NAME=pod, GPULENS_WORKLOAD=SERVING_WORKLOAD,
            # a pod's uid, as the downward API gives it: the replicas' workers are both rank 0 of the same
            # revision, so the agent tells them apart by it (and the hook gives each its own Kineto job id)
            GPULENS_POD_UID=str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpulens-up/demo/{pod}")),
            GPULENS_REGISTRY_DIR=str(L.registry), GPULENS_TRACE_DIR=str(L.traces),
            GPULENS_SOCKET_DIR=str(L.socket_dir), GPULENS_STUB_STATE_DIR=str(L.stub_state),
            GPULENS_STUB_DEVICES=str(len(SERVING_PODS)), OMP_NUM_THREADS="1")
        return ChildSpec(f"demo-replica-{device}", [sys.executable, "-m", "gpulens.up.demo_server", "--libcuda",
                                                    str(self.stub.libcuda), "--device", str(device)],
                         env=env, restart=False)

    async def _replace_trainer_pod(self, incident: str) -> None:
        """Stop the trainer and start it again as a new pod of the same job, with `incident` on."""
        old, new = self.trainer_pod, f"demo-trainer-{int(self.trainer_pod.rsplit('-', 1)[1]) + 1}"
        self.say(f"gpulens up: replacing pod demo/{old} with demo/{new} (same job demo), which has '{incident}'")
        log.info("demo.pod_replaced", old_pod=old, new_pod=new, job_id="demo", incident=incident)
        await self.sup.stop_child("demo-trainer")
        self.layout.incident_file.write_text(incident)
        self.trainer_pod = new
        await self.sup.start(self._trainer_spec(new))

    #: the workload the demo trainer belongs to, as the exporter labels it (docs/exporter.md)
    DEMO_WORKLOAD = ("demo", "job/demo")

    @property
    def demo_workload(self) -> tuple[str, str]:
        return ("demo", SERVING_WORKLOAD) if self.args.serving else self.DEMO_WORKLOAD

    async def _workload_baseline(self, session) -> float | None:
        """The demo workload's recorded baseline (launches/s per worker), or None while it has none."""
        ns, wl = self.demo_workload
        query = f'namespace_workload:gpulens_launches_per_worker:baseline_rate5m{{namespace="{ns}",gpulens_workload="{wl}"}}'
        try:
            async with session.get(f"http://127.0.0.1:{self.ports.prometheus}/api/v1/query",
                                   params={"query": query}) as r:
                result = (await r.json())["data"]["result"] if r.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            return None
        return float(result[0]["value"][1]) if result else None

    async def _wait_for_baseline(self) -> None:
        """Hold the incident until the rules have the workload's healthy baseline.

        The rules judge a change against the workload's own past (docs/alerts.md, "Baselines"): an
        incident induced before that past exists becomes the baseline and is never diagnosed. How
        long the history takes depends on this machine's start-up speed, so wait for the recorded
        series itself rather than for a fixed time."""
        if "prometheus" not in self.sup.children:
            return
        self.say(f"gpulens up: waiting for workload {'/'.join(self.demo_workload)}'s baseline before the incident "
                 f"(the rules need its healthy history first)")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            while (value := await self._workload_baseline(session)) is None:
                await asyncio.sleep(2)
        self.say(f"gpulens up: workload {'/'.join(self.demo_workload)} has its baseline "
                 f"({value:.0f} launches/s per worker)")
        log.info("demo.baseline_established", workload="/".join(self.demo_workload), launches_per_worker=value)

    async def _induce_incident(self) -> None:
        await asyncio.sleep(self.args.incident_after)
        await self._wait_for_baseline()
        incident = self.args.incident
        if self.args.serving:   # command.py allows noisy_neighbor only: on the first replica's GPU
            self.say(f"gpulens up: inducing incident '{incident}' on GPU 0, replica demo/{SERVING_PODS[0]}'s "
                     f"(demo/{SERVING_PODS[1]} on GPU 1 stays healthy)")
        else:
            self.say(f"gpulens up: inducing incident '{incident}' in the demo trainer now")
        log.info("incident.induced", incident=incident)
        if incident in self.NEW_POD_INCIDENTS:
            await self._replace_trainer_pod(incident)
            return
        if incident == "noisy_neighbor":
            env = self.stub.env(GPULENS_STUB_STATE_DIR=str(self.layout.stub_state))
            # The stand-in queues at most 64 operations per process, so the kernel length sets how long
            # a replica's answer waits behind the neighbour: 400 us kept a serving replica at 0.59-0.63 of
            # its baseline, on the rule's 0.6 line (the alert fired and resolved in turn); 1 ms kernels
            # (a batch job's) hold it well under.
            kernel_us = "1000" if self.args.serving else "400"
            await self.sup.start(ChildSpec(
                "noisy-neighbor", [str(self.stub.workload), "--device", "0", "--duration", "100000",
                                   "--kernels", "200", "--kernel-us", kernel_us, "--h2d-bytes", "1048576",
                                   "--sync-every", "1", "--host-us", "1000", "--host-work", "sleep"],
                env=env, restart=False))
        self.layout.incident_file.write_text(incident)

    def _print_urls(self) -> None:
        P = self.ports
        rows = [("metrics (exporter)", f"http://127.0.0.1:{P.exporter}/metrics"),
                ("node agent", f"http://127.0.0.1:{P.agent}/healthz"),
                ("gateway (webhook: POST /v1/alertmanager)", f"http://127.0.0.1:{P.gateway}/healthz")]
        if "prometheus" in self.sup.children:
            # Debian's Prometheus 2.42 serves its classic UI only: /alerts is a 404 there
            rows += [("Prometheus alerts", f"http://127.0.0.1:{P.prometheus}/classic/alerts"),
                     ("Alertmanager", f"http://127.0.0.1:{P.alertmanager}/")]
        rows.append(("captures, reports, annotations", f"http://127.0.0.1:{P.ui}/"))
        rows.append(("runbooks (alerts link here)", f"http://127.0.0.1:{P.ui}/runbooks/"))
        self.urls.update(rows)                       # the captures page lists them too
        self.say("gpulens up: processes:")
        self.say(f"  {'process':<28} {'pid':>7}  log")
        self.say(f"  {'gpulens up (captures page)':<28} {os.getpid():>7}  (this terminal)")
        for name, child in self.sup.children.items():
            self.say(f"  {name:<28} {str(child.pid or '-'):>7}  {child.log_path}")
        width = max(len(r[0]) for r in rows)
        self.say("gpulens up: ready. Open:")
        for name, url in rows:
            self.say(f"  {name:<{width}}  {url}")
        for line in self.hand_lines():
            self.say(line)
        self.say("  Ctrl-C stops everything.")

    def hand_lines(self) -> list[str]:
        """What `up` prints for doing things by hand: a capture of the demo's job, or, without --demo,
        of a trainer one arms oneself (namespace `local` unless GPULENS_NAMESPACE says otherwise, job
        its GPULENS_JOB_ID), and how to arm one, dynolog included when that is the trigger."""
        L, P, a = self.layout, self.ports, self.args
        gpulens = Path(sys.executable).parent / "gpulens"
        job = (SERVING_REVISION if a.serving else "demo") if a.demo else "<GPULENS_JOB_ID>"
        lines = [f"  start a capture by hand:  {gpulens} capture start --url http://127.0.0.1:{P.gateway} "
                 f"--token-file {L.token_file('gateway')} --namespace {'demo' if a.demo else 'local'} "
                 f"--job {job} --wait",
                 f"  arm a trainer of your own:  PYTHONPATH={hook_path()} GPULENS_JOB_ID=<job> "
                 f"GPULENS_REGISTRY_DIR={L.registry} GPULENS_SOCKET_DIR={L.socket_dir} GPULENS_TRACE_DIR={L.traces}"
                 + ("" if a.demo else "  (then capture it with --namespace local --job <job>)")]
        if a.trigger != "builtin":
            lines.append(f"  a dynolog daemon for it (--trigger {a.trigger}) must share the trainers' socket folder:  "
                         f"KINETO_IPC_SOCKET_DIR={L.socket_dir} dynolog --enable_ipc_monitor")
        return lines

    def _remove_socket_dir(self) -> int:
        """Kineto leaves a `dynoconfigclient<uuid>` folder per worker in the socket dir; every process
        is stopped by now, so the whole (derived, per-workdir) folder goes."""
        folder = self.layout.socket_dir
        try:
            count = sum(1 for p in folder.iterdir() if p.name.startswith("dynoconfigclient"))
        except OSError:
            return 0
        shutil.rmtree(folder, ignore_errors=True)
        return count

    def _remove_stale_registrations(self) -> int:
        """Records whose process is gone (a SIGTERMed worker has no atexit) would mislead the next run."""
        removed = 0
        for path in self.layout.registry.glob("*.json"):
            try:
                pid = json.loads(path.read_text()).get("host_pid") or 0
            except (OSError, ValueError):
                pid = 0
            if not pid or not Path(f"/proc/{pid}").exists():
                path.unlink(missing_ok=True)
                removed += 1
        return removed
