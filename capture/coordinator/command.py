"""`gpulens coordinator`: one per (job, attempt); the capture hot path for that job.

Flags follow docs/ARCHITECTURE.md ("Command-line contract"); see docs/coordinator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gpulens.ground.argtypes import host_port as _host_port
from gpulens.ground.lifecycle import serve_until_stopped
from gpulens.ground.logs import get_logger

log = get_logger("coordinator")


def _resources(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or not set(value) <= {"requests", "limits"} or \
            not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError('expected {"requests": {...}, "limits": {...}}')
    return value


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key.strip(), value.strip()


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--listen", type=_host_port, default=("127.0.0.1", 9452), metavar="HOST:PORT", help="default 127.0.0.1:9452")
    a("--job", required=True, help="the job id (GPULENS_JOB_ID of its workers)")
    a("--attempt", type=int, required=True)
    a("--namespace", required=True)
    a("--discovery", choices=["local", "kubernetes"], required=True)
    a("--registry-dir", type=Path, help="registration records (--discovery local)")
    a("--selector", help="label selector of the job's pods (--discovery kubernetes)")
    a("--serving", action="store_true",
      help="the job is a serving workload revision: its pods are replicas, each its own world; captures may name "
           "pods or take N replicas (docs/kubernetes.md, 'Serving workloads')")
    a("--kubeconfig", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    agent = parser.add_mutually_exclusive_group(required=True)
    agent.add_argument("--agent-url", help="one agent for every target (embedded mode)")
    agent.add_argument("--agent-url-template", help="per node, e.g. 'http://{node_ip}:9451' ({node}, {node_ip})")
    a("--archive-root", required=True, help="file:///path or s3://bucket/prefix")
    a("--s3-endpoint", help="S3-compatible endpoint URL")
    a("--accepted-token-file", "--token-file", dest="token_file", type=Path, required=True,
      help="file with the bearer token callers must present (the gateway, gpulens capture)")
    a("--agent-token-file", type=Path, required=True, help="bearer token for the node agents")
    a("--grafana-url", help="Grafana base URL for capture annotations")
    a("--grafana-token-file", type=Path, help="Grafana service-account token")
    a("--grafana-org-id", type=int, help="X-Grafana-Org-Id for a non-default organisation")
    a("--annotations-file", type=Path, help="without Grafana: annotations JSON file (an HTML page is written beside it)")
    a("--report-base-url", help="browser URL of the archive root, for links in annotations")
    a("--analysis", choices=["local", "job", "none"], default="none",
      help="run `gpulens analyze` after convergence: as a child process (local) or a Kubernetes Job (job)")
    a("--analysis-image", help="--analysis job: the image of the Job (gpulens's own)")
    a("--analysis-image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    a("--analysis-image-pull-secret", action="append", default=[], metavar="NAME", help="repeatable")
    a("--analysis-service-account", metavar="NAME",
      help="--analysis job: the Job pod's ServiceAccount (the coordinator's, for the same archive identity)")
    a("--analysis-env-from-secret", metavar="NAME", help="--analysis job: Secret whose keys become the Job's env "
                                                         "(archive credentials)")
    a("--analysis-resources", type=_resources, default={}, metavar="JSON",
      help='--analysis job: the container\'s resources, e.g. \'{"limits": {"memory": "8Gi"}}\'')
    a("--analysis-label", action="append", default=[], type=_label, metavar="KEY=VALUE",
      help="--analysis job: a label on the Job and its pod (repeatable; the operator passes the job's)")
    a("--analysis-timeout-s", type=float, default=1800.0, help="bound on one analysis (a Job's activeDeadlineSeconds is this + 60)")
    a("--analysis-ttl-s", type=int, default=3600, help="--analysis job: ttlSecondsAfterFinished")
    a("--analysis-scheduler", metavar="tcp://HOST:PORT",
      help="--analysis job: the Job submits each rank to this Dask scheduler (`gpulens analyze --scheduler`; "
           "the chart's dask.enabled) instead of a local cluster inside the Job")
    a("--coordinator-name", help="the CaptureCoordinator this coordinator serves (owner of its analysis Jobs)")
    a("--coordinator-uid", help="its metadata.uid (with --coordinator-name)")
    a("--state-dir", type=Path, help="keep a copy of each finished capture's status here")
    a("--budget-mb", type=int, default=200, metavar="MIB",
      help="uncompressed trace MiB per rank for captures that name none (docs/coordinator.md, 'Trace budget')")
    a("--start-delay-s", type=float, default=12.0, help="dynolog start delay allowance (poll 5 s + warm-up 7 s)")
    a("--archive-margin-s", type=float, default=20.0, help="verify + archive allowance on the node")
    a("--report-margin-s", type=float, default=10.0, help="agent deadline -> coordinator deadline")
    a("--poll-interval-s", type=float, default=1.0, help="how often each agent is asked for statuses")
    a("--start-lead-s", type=float, default=12.0, metavar="S",
      help="iteration captures start every rank at one iteration this many seconds of the fastest rank's stepping "
           "ahead of the furthest rank (dispatch + Kineto's 5 s poll); a rank past it anyway ends missed_start")
    a("--wall-start-lead-s", type=float, default=16.0, metavar="S",
      help="wall-clock captures start every rank's window at one instant at least this long after dispatch, "
           "on the phase of Kineto's 1 s profiler tick (>= 13: the agent "
           "needs 12 s before it to send the config: Kineto's <= 5 s poll, its 1 s profiler tick, 5 s warm-up, 1 s "
           "slack); the manifest records it and each rank's actual start")
    a("--max-captures", type=int, default=200, help="finished captures kept in memory")
    a("--baseline-after-s", type=float, default=0.0, metavar="S",
      help="take one healthy baseline capture once the job has run S seconds (0: never; later reports compare "
           "with the job's latest baseline)")
    a("--baseline-duration-ms", type=int, default=3000, help="window of the automatic baseline capture")
    a("--hang-window-ms", type=int, default=1000, metavar="MS",
      help="after a hang capture, a Kineto window of this many ms of every rank (its activity, or its absence "
           "while the ranks hang, kept as evidence); 0: none (docs/coordinator.md, 'Hang captures')")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _api_client(kubeconfig: str | None):
    import os

    from kubernetes import client, config
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> int:
    import aiohttp
    from aiohttp import web

    from gpulens.capture.annotations import FileSink, GrafanaSink

    from .agents import AgentFleet
    from ..wire.auth import Credentials, SecretFile
    from .deadlines import DeadlinePolicy
    from .discovery import AgentUrls, LocalDiscovery
    from .fanout import FanoutSettings
    from .server import make_app
    from .service import Coordinator, CoordinatorSettings

    credentials = Credentials(tokens=(SecretFile.required(args.token_file),))
    agent_token = SecretFile.required(args.agent_token_file)
    agents = AgentUrls(url=args.agent_url, template=args.agent_url_template)
    # one Kubernetes API client for discovery and analysis Jobs (in-cluster ServiceAccount token and CA)
    api_client = _api_client(args.kubeconfig) if args.discovery == "kubernetes" or \
        args.analysis == "job" else None
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=16)  # no global cap: one slow agent must not starve the rest
    async with aiohttp.ClientSession(connector=connector) as session:
        client = AgentFleet(session, agent_token)
        if args.discovery == "local":
            discovery = LocalDiscovery(args.registry_dir, job_id=args.job, attempt=args.attempt,
                                       namespace=args.namespace, agents=agents, serving=args.serving)
        else:
            from .kube_discovery import KubernetesDiscovery
            discovery = KubernetesDiscovery(api_client, namespace=args.namespace,
                                            selector=args.selector, job_id=args.job, attempt=args.attempt,
                                            agents=agents, agent_client=client, serving=args.serving)
        sink = None
        if args.grafana_url:
            # Annotations are a side effect: a missing token is a visible annotation failure
            # (401, state `retrying`), never a coordinator that cannot start and capture.
            token = SecretFile.optional(args.grafana_token_file, lambda p: log.warning(
                "annotations.token_missing", path=str(p), grafana_url=args.grafana_url,
                detail="annotations are refused until the file has the token")) if args.grafana_token_file else None
            sink = GrafanaSink(session, args.grafana_url, token, org_id=args.grafana_org_id)
        elif args.annotations_file:
            sink = FileSink(args.annotations_file)
        settings = CoordinatorSettings(
            job_id=args.job, attempt=args.attempt, namespace=args.namespace, archive_root=args.archive_root,
            serving=args.serving,
            s3_endpoint=args.s3_endpoint, report_base_url=args.report_base_url, state_dir=args.state_dir,
            max_captures=args.max_captures, baseline_after_s=args.baseline_after_s,
            baseline_duration_ms=args.baseline_duration_ms, budget_mb=args.budget_mb,
            hang_window_ms=args.hang_window_ms,
            deadlines=DeadlinePolicy(start_delay_s=args.start_delay_s, archive_s=args.archive_margin_s,
                                     report_s=args.report_margin_s),
            fanout=FanoutSettings(poll_interval_s=args.poll_interval_s, start_lead_s=args.start_lead_s,
                                  wall_start_lead_s=args.wall_start_lead_s))
        coordinator = Coordinator(settings, discovery, client, annotations=sink,
                                  analysis=analysis_for(args, api_client))
        coordinator.schedule_baseline()
        runner = web.AppRunner(make_app(coordinator, credentials), access_log=None)
        await runner.setup()
        host, port = args.listen
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            log.error("coordinator.listen_failed", listen=f"{host}:{port}", error=str(exc))
            await runner.cleanup()
            return 1
        log.info("coordinator.ready", listen=f"{host}:{port}", job_id=args.job, attempt=args.attempt,
                 namespace=args.namespace, discovery=args.discovery)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    log.info("coordinator.stopped")
    return 0


def analysis_for(args: argparse.Namespace, api_client=None):
    """The analysis runner `--analysis` asks for: a child process, a Kubernetes Job, or none."""
    if args.analysis == "local":
        from .analysis_runner import AnalysisRunner
        return AnalysisRunner(s3_endpoint=args.s3_endpoint, timeout_s=args.analysis_timeout_s)
    if args.analysis == "job":
        from gpulens.capture.archive.paths import host_dir

        from .analysis_job import AnalysisJobRunner, AnalysisJobSpec, OwnerRef
        owner = OwnerRef(args.coordinator_name, args.coordinator_uid) if args.coordinator_uid else None
        spec = AnalysisJobSpec(namespace=args.namespace, image=args.analysis_image, job_id=args.job,
                               attempt=args.attempt, s3_endpoint=args.s3_endpoint,
                               image_pull_policy=args.analysis_image_pull_policy,
                               image_pull_secrets=tuple(args.analysis_image_pull_secret),
                               service_account=args.analysis_service_account,
                               env_from_secret=args.analysis_env_from_secret, resources=args.analysis_resources,
                               labels=dict(args.analysis_label), owner=owner, timeout_s=args.analysis_timeout_s,
                               ttl_s=args.analysis_ttl_s, host_archive_dir=host_dir(args.archive_root),
                               scheduler=args.analysis_scheduler)
        return AnalysisJobRunner(api_client if api_client is not None else _api_client(args.kubeconfig), spec)
    return None


def _check(args: argparse.Namespace) -> str | None:
    if args.discovery == "local" and not args.registry_dir:
        return "--discovery local needs --registry-dir"
    if args.discovery == "kubernetes" and not args.selector:
        return "--discovery kubernetes needs --selector"
    if args.grafana_url and args.annotations_file:
        return "give --grafana-url or --annotations-file, not both"
    if args.analysis == "job" and not args.analysis_image:
        return "--analysis job needs --analysis-image"
    if bool(args.coordinator_name) != bool(args.coordinator_uid):
        return "give --coordinator-name and --coordinator-uid together"
    if args.analysis_scheduler and not args.analysis_scheduler.startswith(("tcp://", "tls://")):
        return "--analysis-scheduler must be tcp://HOST:PORT or tls://HOST:PORT"
    if args.analysis_timeout_s <= 0 or args.analysis_ttl_s < 0:
        return "--analysis-timeout-s must be > 0 and --analysis-ttl-s >= 0"
    if not args.archive_root.startswith(("file://", "s3://")):
        return "--archive-root must be file:///path or s3://bucket/prefix"
    if not 13 <= args.wall_start_lead_s <= 300:
        return ("--wall-start-lead-s must be 13..300: the agent needs 12 s (Kineto's poll, a profiler tick, its "
                "warm-up) between sending the config and the start")
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"gpulens coordinator: {problem}", file=sys.stderr)
        return 2

    return serve_until_stopped(lambda stop: serve(args, stop), prog="gpulens coordinator")
