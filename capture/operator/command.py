"""`gpulens operator`: the leader-elected kopf operator, plus the arming webhook and a health endpoint.

Every replica serves `/healthz` (and `/mutate` when TLS files are given, so the webhook stays up
during a leader change); only the replica holding the Lease reconciles. `--once` runs one resync
and exits, for debugging a cluster by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket

from gpulens.ground.argtypes import host_port as _host_port
from gpulens.ground.logs import get_logger

log = get_logger("operator")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="operator config YAML (see docs/kubernetes.md)")
    parser.add_argument("--listen", default="0.0.0.0:9454", metavar="HOST:PORT",
                        help="health (and, with --tls-cert/--tls-key, webhook) server (default %(default)s)")
    parser.add_argument("--tls-cert", metavar="FILE", help="serve the arming webhook over TLS with this certificate")
    parser.add_argument("--tls-key", metavar="FILE")
    parser.add_argument("--no-reconcile", action="store_true", help="serve the webhook only, never reconcile")
    parser.add_argument("--once", action="store_true", help="run one cluster-wide resync and exit")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname(),
                        help="leader-election identity (default: $POD_NAME or the host name)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _api_client(kubeconfig: str | None):
    """In-cluster credentials (refreshed as the token rotates), else a kubeconfig. kopf logs in
    the same way on its own: KUBECONFIG is set for it when --kubeconfig is given."""
    from kubernetes import client, config
    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


def _attempt_reader(kubeconfig: str | None):
    """The webhook's reader of batch Job failures (job_attempts.py); None, logged, without API
    credentials: batch Job pods are then armed as attempt 0, as before the rule."""
    from .job_attempts import JobAttempts
    from .kube import KubeApi
    try:
        return JobAttempts(KubeApi(_api_client(kubeconfig))).attempt_of
    except Exception as exc:  # noqa: BLE001 - the webhook still arms without it
        log.warning("webhook.no_api", reason=f"{type(exc).__name__}: {exc}", effect="batch Job pods get attempt 0")
        return None


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from aiohttp import web

    from .config import load_config
    from .webhook import make_app, reload_certificates, tls_context

    cfg = load_config(args.config)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    host, port = _host_port(args.listen)
    app = make_app(cfg.arming if args.tls_cert else None, cfg.hook_image,
                   _attempt_reader(args.kubeconfig) if args.tls_cert else None, own_namespace=cfg.namespace)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ssl_ctx = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    await web.TCPSite(runner, host, port, ssl_context=ssl_ctx).start()
    log.info("server.listening", listen=args.listen, webhook=bool(ssl_ctx))
    reloader = asyncio.create_task(reload_certificates(ssl_ctx, args.tls_cert, args.tls_key, stop)) \
        if ssl_ctx else None
    try:
        if args.no_reconcile:
            await stop.wait()
            return 0
        return await lead_and_reconcile(args, cfg, stop)
    finally:
        stop.set()
        if reloader is not None:
            await reloader
        await runner.cleanup()


async def lead_and_reconcile(args: argparse.Namespace, cfg, stop: asyncio.Event) -> int:
    import kopf

    from .handlers import build_registry
    from .kube import KubeApi, KubeError
    from .leadership import LeaseElector
    from .reconcile import Reconciler
    from .stopping import stopped_within

    api_client = _api_client(args.kubeconfig)
    api = KubeApi(api_client)
    reconciler = Reconciler(api, cfg, captures=_captures_fetcher(api, cfg))
    le = cfg.leader_election
    elector = LeaseElector(api_client, cfg.namespace, le.lease_name, args.identity,
                           le.lease_duration_s, le.renew_period_s) if le.enabled else None
    if elector is not None and not await elector.acquire(stop):
        return 0
    lost = asyncio.Event()
    tasks = []

    async def resync_forever() -> None:
        while not stop.is_set():
            try:
                plans = await asyncio.to_thread(reconciler.resync)
                log.debug("resync.done", jobs=len(plans))
            except KubeError as exc:
                log.warning("resync.failed", reason=str(exc))
            await stopped_within(stop, cfg.resync_interval_s)

    if elector is not None:
        tasks.append(asyncio.create_task(elector.keep(stop, lost)))
    tasks.append(asyncio.create_task(resync_forever()))
    try:
        await kopf.operator(registry=build_registry(reconciler), clusterwide=True, standalone=True,
                            stop_flag=stop, memo=None)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if elector is not None and not lost.is_set():
            await asyncio.to_thread(elector.release)
    return 1 if lost.is_set() else 0


def _captures_fetcher(api, cfg):
    """Reads coordinators' capture lists with the coordinator token from the operator's Secret."""
    import base64
    import binascii

    from .captures_probe import http_captures
    from .kube import KubeError

    def fetch(endpoint: str):
        try:
            data = api.get_secret_data(cfg.namespace, cfg.tokens_secret) or {}
            token = base64.b64decode(data.get("coordinator", "")).decode().strip()
        except (KubeError, binascii.Error, UnicodeDecodeError):
            return None
        return http_captures(token)(endpoint) if token else None
    return fetch


def run(args: argparse.Namespace) -> int:
    if args.once:
        from .config import load_config
        from .kube import KubeApi, KubeError
        from .reconcile import Reconciler
        try:
            plans = Reconciler(KubeApi(_api_client(args.kubeconfig)), load_config(args.config)).resync()
        except KubeError as exc:
            log.error("resync.failed", reason=str(exc))
            return 1
        for p in plans:
            print(f"{p.key[0]}/{p.key[1]}: keep={p.keep or '-'} create={'yes' if p.create else 'no'} "
                  f"delete={','.join(p.delete) or '-'} ({p.reason})")
        return 0

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await serve(args, stop)

    from .config import OperatorConfigError
    try:
        return asyncio.run(main())
    except (OperatorConfigError, ValueError, OSError) as exc:
        log.error("operator.failed", reason=str(exc))
        return 2
