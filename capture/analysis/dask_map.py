"""Run the per-rank map on Dask: a local cluster by default, or an existing one (`--scheduler`).

Why Dask (dask.distributed): it is the existing engine with what this needs and nothing more:
one task per rank on worker processes with a memory limit each (the nanny restarts a worker that
crosses it), a retry of a lost worker's tasks on another worker, and a `tcp://` scheduler a
Kubernetes deployment can run next to the archive. The driver only submits small `RankJob`s and
receives small per-rank summaries; traces never pass through it.

A worker lost mid-rank (killed for memory, pod deleted) costs a retry of that rank on another
worker (`RETRIES`); a rank that loses its worker every time is reported `unanalysable` with the
reason, and the rest of the capture is analysed.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator

from gpulens.ground.logs import EventLogger

from .rank_work import RankJob, analyse_rank

__all__ = ["ClusterPlan", "plan_cluster", "dask_client", "map_ranks", "RETRIES", "LOST"]

RETRIES = 1                     # a lost worker's rank is tried once more on another worker
WORKER_BASE_BYTES = 768 << 20   # an idle worker with pandas and HTA imported, and headroom
#: peak worker bytes per byte of trace JSON: measured 349-454 MiB at peak for ~29 MiB ranks of real
#: GPU+NCCL events with unique pairing ids (8-128 ranks; ~120 MiB of it the process itself, the rest
#: ~6x for inspection and ~6x for HTA's load; BENCHMARKS.md, "Analysis at scale with unique pairing
#: ids"), so 16 over the base leaves headroom. (The earlier 50 was sized from a bench artifact:
#: repeated correlation ids made HTA's joins many-to-many.) Small traces stay near the base.
JSON_FACTOR = 16
GZIP_EXPANSION = 12             # a gzipped Kineto trace's JSON is ~10-16x its size (see reference)
MIN_WORKER_BYTES = 1 << 30
LOST = "lost"                   # map_ranks' marker for a rank whose worker died (with the reason)


@dataclass(frozen=True)
class ClusterPlan:
    scheduler: str | None       # None: start a local cluster
    workers: int
    memory_limit: int           # bytes per worker (local cluster only)
    why: str


def _json_bytes(artifact) -> int:
    """The JSON a trace decompresses to: the manifest's `sizes.uncompressed` (the agent counts it
    while it verifies, issue 27), else estimated from the stored size (gzip: GZIP_EXPANSION)."""
    v = (getattr(artifact, "sizes", None) or {}).get("uncompressed")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return artifact.size * (GZIP_EXPANSION if artifact.uri.endswith(".gz") else 1)


def _total_memory() -> int:
    """This machine's memory, or the container's cgroup limit when lower (Dask reads both)."""
    from distributed.system import MEMORY_LIMIT
    return int(MEMORY_LIMIT)


def plan_cluster(artifacts: list, jobs: int, scheduler: str | None, memory_limit: int | None) -> ClusterPlan:
    """Workers = `jobs`, each allowed enough for the largest trace; fewer workers when that many
    would not fit in this machine's memory (a worker that does not fit is a worker killed)."""
    if scheduler:
        return ClusterPlan(scheduler, 0, 0, "an existing Dask cluster (its own worker limits apply)")
    largest = max((_json_bytes(a) for a in artifacts), default=0)
    limit = memory_limit or max(MIN_WORKER_BYTES, WORKER_BASE_BYTES + JSON_FACTOR * largest)
    budget = int(_total_memory() * 0.9)
    workers = max(1, min(jobs, len(artifacts) or 1))
    why = (f"{workers} worker(s) of {limit >> 20} MiB" + ("" if memory_limit else
           f": {WORKER_BASE_BYTES >> 20} MiB + {JSON_FACTOR} x the largest trace's JSON ({largest >> 20} MiB)"))
    if workers * limit > budget:
        fit = max(1, budget // limit)
        if fit < workers:
            why += f"; only {fit} fit in this machine's {budget >> 20} MiB"
            workers = fit
        if limit > budget and not memory_limit:
            why += f"; capped at this machine's {budget >> 20} MiB"
            limit = budget
    return ClusterPlan(None, workers, limit, why)


@contextlib.contextmanager
def dask_client(plan: ClusterPlan, log: EventLogger) -> Iterator[Any]:
    """A connected `distributed.Client`; the local cluster (if any) is closed on exit. Raises
    OSError when an existing scheduler cannot be reached within Dask's connect timeout
    (`distributed.comm.timeouts.connect`, e.g. DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT=10s)."""
    import dask
    from distributed import Client, LocalCluster

    if plan.scheduler:
        try:
            client = Client(plan.scheduler, timeout=dask.config.get("distributed.comm.timeouts.connect"))
        except (OSError, TimeoutError) as exc:
            raise OSError(f"cannot reach the Dask scheduler {plan.scheduler}: {exc}") from exc
        log.info("dask.connected", scheduler=plan.scheduler, workers=len(client.scheduler_info()["workers"]))
        try:
            yield client
        finally:
            client.close()
        return
    settings = {
        "distributed.scheduler.allowed-failures": RETRIES,
        # results are small and nothing is spilled: only the hard limit matters (a paused worker
        # holding on to a finished rank's memory would otherwise never take the next one)
        "distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95,
        "distributed.admin.tick.limit": "1h",
    }
    with dask.config.set(settings):
        cluster = LocalCluster(n_workers=plan.workers, threads_per_worker=1, processes=True,
                               memory_limit=plan.memory_limit, host="127.0.0.1", silence_logs=logging.CRITICAL,
                               # Dask's HTTP endpoints (health, metrics) on loopback, any free port: never 8787
                               dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False})
        try:
            client = Client(cluster)
            log.info("dask.started", scheduler=cluster.scheduler_address, workers=plan.workers,
                     memory_limit_bytes=plan.memory_limit, why=plan.why)
            try:
                yield client
            finally:
                client.close()
        finally:
            cluster.close()


def _lost_detail(exc: BaseException, plan: ClusterPlan, job: RankJob) -> str:
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        limit = f" (memory limit {plan.memory_limit >> 20} MiB per worker)" if plan.memory_limit else ""
        return (f"the Dask worker analysing this rank died {RETRIES + 1} time(s){limit}; the trace is "
                f"{job.artifact.size} bytes in the archive: killed, e.g. out of memory, or its pod deleted")
    return f"analysing this rank failed on its worker: {type(exc).__name__}: {exc}"[:500]


def map_ranks(client: Any, jobs: list[RankJob], plan: ClusterPlan, log: EventLogger) -> Iterator[tuple[int, dict | tuple]]:
    """(job index, rank summary) as ranks finish, or (index, (LOST, detail)) for a rank Dask gave up on."""
    from distributed import as_completed

    futures = {client.submit(analyse_rank, job, key=f"gpulens-rank-{job.index}-{_safe(job.artifact.target_id)}",
                             pure=False): job for job in jobs}
    try:
        for n, fut in enumerate(as_completed(futures), 1):
            job = futures[fut]
            try:
                result = fut.result()
            except Exception as exc:  # noqa: BLE001 - KilledWorker, or an error raised on the worker
                detail = _lost_detail(exc, plan, job)
                log.warning("rank.unanalysable", rank=job.artifact.rank, target_id=job.artifact.target_id,
                            progress=f"{n}/{len(jobs)}", detail=detail)
                yield job.index, (LOST, detail)
                continue
            log.info("rank.mapped", rank=job.artifact.rank, target_id=job.artifact.target_id,
                     progress=f"{n}/{len(jobs)}", status=result["status"], reason=result["reason"],
                     worker_peak_rss=result.get("worker", {}).get("peak_rss_bytes"))
            yield job.index, result
    finally:
        for fut in futures:
            fut.release()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:60]
