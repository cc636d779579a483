"""Assembles a running agent from its options: registry, trigger, observer, verifier pool, archive,
status store, HTTP API. `serve()` is what `gpulens agent` runs; tests call `start_agent()` to run
the same assembly in-process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from gpulens.ground.logs import get_logger

from ..archive import RetryPolicy, open_archive
from ..dynolog import DynologClient, KinetoEndpoint
from .api import MAX_BODY_BYTES, make_app
from .metrics import AgentMetrics
from .observation import Observer
from .pipeline import Pipeline, PipelineSettings
from .registry import WorkerRegistry
from .service import Agent, Housekeeping
from .space import NodeDisk
from .store import StatusStore
from .triggers import BuiltinTrigger, DynologTrigger, Trigger, choose_trigger

__all__ = ["AgentOptions", "RunningAgent", "start_agent", "serve"]

_log = get_logger("agent")


@dataclass
class AgentOptions:
    host: str
    port: int
    node: str
    registry_dir: Path
    trace_dir: Path
    state_dir: Path
    archive_root: str
    token: str
    trigger: str = "auto"                  # auto | builtin | dynolog
    dynolog_addr: str = "127.0.0.1:1778"
    socket_dir: str | None = None          # builtin: <dir>/dynolog; None: abstract @dynolog
    s3_endpoint: str | None = None
    verify_workers: int = 1
    keep_local: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    stale_grace_s: float = 120.0
    retry_interval_s: float = 1.0
    archive_policy: RetryPolicy = field(default_factory=RetryPolicy)
    dynolog_timeout_s: float = 3.0
    compress_level: int = 1                # issue 27: gzip level of the archive copy (0: archive the trace as is)
    min_free_mb: int = 1024                # never let a capture leave less free on the node's disks


@dataclass
class RunningAgent:
    agent: Agent
    runner: web.AppRunner
    port: int
    backend: str
    endpoint: KinetoEndpoint | None
    observer: Observer
    pool: ProcessPoolExecutor

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.agent.stop()
        await self.observer.stop()
        if self.endpoint is not None:
            await self.endpoint.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


async def start_agent(o: AgentOptions) -> RunningAgent:
    for d in (o.state_dir, o.trace_dir):
        Path(d).mkdir(parents=True, exist_ok=True)
    archive = open_archive(o.archive_root, endpoint_url=o.s3_endpoint) if o.archive_root.startswith("s3://") \
        else open_archive(o.archive_root)
    backend = await choose_trigger(o.trigger, o.dynolog_addr)
    metrics = AgentMetrics()  # this agent's own registry
    endpoint: KinetoEndpoint | None = None
    trigger: Trigger
    if backend == "builtin":
        if o.socket_dir and not os.path.isdir(o.socket_dir):
            os.makedirs(o.socket_dir)
            os.chmod(o.socket_dir, 0o1777)  # trainers (any uid) create their client sockets here
            _log.info("ipc.socket_dir_created", path=o.socket_dir)
        endpoint = KinetoEndpoint(o.socket_dir)
        await endpoint.start()
        trigger = BuiltinTrigger(endpoint)
    elif backend == "dynolog":
        trigger = DynologTrigger(DynologClient.from_addr(o.dynolog_addr, timeout_s=o.dynolog_timeout_s,
                                                         on_call=metrics.dynolog_call))
    else:
        raise ValueError(f"unknown trigger {o.trigger!r}: auto, builtin or dynolog")
    observer = Observer()
    # spawn, not fork: the parent has an event loop and threads; workers import only the verifier
    pool = ProcessPoolExecutor(max_workers=o.verify_workers, mp_context=multiprocessing.get_context("spawn"))
    agent: Agent | None = None
    runner: web.AppRunner | None = None
    try:
        registry = WorkerRegistry(Path(o.registry_dir), stale_grace_s=o.stale_grace_s)
        store = StatusStore(Path(o.state_dir))
        observer.start()
        settings = PipelineSettings(node=o.node, trace_dir=Path(o.trace_dir), archive_root=o.archive_root,
                                    retry_interval_s=o.retry_interval_s, keep_local=o.keep_local,
                                    archive_policy=o.archive_policy,
                                    disk=NodeDisk(Path(o.state_dir) / "staging", compress_level=o.compress_level,
                                                  min_free_bytes=o.min_free_mb << 20),
                                    socket_dir=Path(o.socket_dir) if o.socket_dir else None)
        pipeline = Pipeline(settings, registry=registry, trigger=trigger, store=store, observer=observer,
                            verify_pool=pool, archive=archive, metrics=metrics)
        agent = Agent(pipeline=pipeline, store=store, registry=registry, archive_root=o.archive_root,
                      housekeeping=Housekeeping())
        if endpoint is not None:
            endpoint.on_delivered = agent.on_delivered
            endpoint.on_kineto = agent.on_kineto
        await agent.start()
        runner = web.AppRunner(make_app(agent, o.token, max_body_bytes=o.max_body_bytes, metrics=metrics), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, o.host, o.port)
        await site.start()
    except BaseException:
        if runner is not None:
            await runner.cleanup()
        if agent is not None:
            await agent.stop()
        await observer.stop()
        if endpoint is not None:
            await endpoint.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    port = runner.addresses[0][1]
    _log.info("agent.listening", host=o.host, port=port, node=o.node, trigger=backend,
              ipc=endpoint.describe() if endpoint else None, archive_root=o.archive_root)
    return RunningAgent(agent, runner, port, backend, endpoint, observer, pool)


async def serve(o: AgentOptions) -> int:
    running = await start_agent(o)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _log.info("agent.stopping")
    await running.stop()
    return 0
