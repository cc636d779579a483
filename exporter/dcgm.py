"""DCGM as a source: scrape the node-local dcgm-exporter and re-expose chosen device fields.

dcgm-exporter's text is parsed with prometheus_client's parser. DCGM marks missing values with
"blank" sentinels (DCGM_INT32_BLANK = 0x7ffffff0 and larger int64/fp64 blanks); those samples are
dropped, never exported as 2 billion degrees. PCIe traffic arrives as a rate gauge (bytes/s, the
default counters file) or, in custom configurations, as a counter; either way it is accumulated
into a monotonic byte counter: rates are integrated over the time between polls (capped, so an
outage is not filled with a guess), counters are differenced with resets (a smaller value means
dcgm-exporter restarted) counted from zero.

dcgm-exporter in Kubernetes mode (the GPU Operator's and the standalone chart's default: it mounts
the kubelet's pod-resources socket) names the pod a GPU is allocated to in each sample's
`namespace`/`pod` labels (empty when none). That name is kept per GPU, so the device fields can be
joined to the pod where NVML cannot say who runs on the GPU (service.py: NVML's answer wins).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from gpulens.ground.logs import get_logger

from .health import DISABLED, FAILING, SourceHealth

if TYPE_CHECKING:
    from .dcgm_discovery import Finding

__all__ = ["DcgmSnapshot", "DcgmSource", "DcgmParseError", "GAUGE_FIELDS", "PCIE_FIELDS", "BLANK_THRESHOLD"]

log = get_logger("exporter")

#: DCGM field -> (gpulens metric, scale to the metric's unit)
GAUGE_FIELDS: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gpulens_dcgm_gpu_utilization_ratio", 0.01),
    "DCGM_FI_PROF_SM_ACTIVE": ("gpulens_dcgm_sm_active_ratio", 1.0),
    "DCGM_FI_DEV_FB_USED": ("gpulens_dcgm_memory_used_bytes", 1024.0 * 1024.0),
    "DCGM_FI_DEV_POWER_USAGE": ("gpulens_dcgm_power_watts", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("gpulens_dcgm_temperature_celsius", 1.0),
}
PCIE_FIELDS = {"DCGM_FI_PROF_PCIE_TX_BYTES": "tx", "DCGM_FI_PROF_PCIE_RX_BYTES": "rx"}
BLANK_THRESHOLD = 0x7FFFFFF0          # DCGM_INT32_BLANK; DCGM_INT64_BLANK and DCGM_FP64_BLANK are larger
MAX_BODY = 16 << 20


class DcgmParseError(ValueError):
    """The page is not Prometheus text exposition."""


@dataclass(frozen=True)
class DcgmSnapshot:
    gauges: dict[tuple[str, str], float] = field(default_factory=dict)      # (metric, gpu) -> value
    pcie_bytes: dict[tuple[str, str], float] = field(default_factory=dict)  # (gpu, tx|rx) -> total
    #: gpu -> (namespace, pod) dcgm-exporter names for it; only GPUs it names exactly one pod for
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)


def _gpu(labels: dict[str, str]) -> str | None:
    gpu = labels.get("gpu")
    if gpu is None or gpu == "":
        return None
    mig = labels.get("GPU_I_ID")
    return f"{gpu}-mig{mig}" if mig not in (None, "") else gpu


class DcgmSource:
    """Scrapes one URL: the one given (--dcgm-url), or whichever `locate` finds before each poll
    (dcgm_discovery.DcgmFinder.find: a Finding with a URL, or the state and reason of none)."""

    def __init__(self, url: str | None, health: SourceHealth, *, interval_s: float = 10.0, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, locate: Callable[[], Finding] | None = None):
        self.url = url
        self.health = health
        self._locate = locate
        self._found = f"scraping {url} (--dcgm-url)" if url else ""
        self.interval_s = interval_s
        self._timeout = timeout_s
        self._max_gap = max(3 * interval_s, 30.0)
        self._clock = clock
        self._gauges: dict[tuple[str, str], float] = {}
        self._totals: dict[tuple[str, str], float] = {}
        self._pods: dict[str, tuple[str, str]] = {}
        self._prev: dict[tuple[str, str], tuple[float, float]] = {}   # key -> (raw value, time)
        self.blanks_dropped = 0
        health.waiting(f"first scrape of {url} pending" if url else "looking for dcgm-exporter")

    @property
    def snapshot(self) -> DcgmSnapshot:
        return DcgmSnapshot(gauges=dict(self._gauges), pcie_bytes=dict(self._totals), pods=dict(self._pods))

    def ingest(self, text: str, now: float | None = None) -> None:
        """Apply one dcgm-exporter page; raises DcgmParseError (state unchanged) if it is malformed."""
        from prometheus_client.parser import text_string_to_metric_families

        now = self._clock() if now is None else now
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:   # the parser raises ValueError, and IndexError/TypeError on odd input
            raise DcgmParseError(f"malformed dcgm-exporter response: {exc}") from exc
        gauges: dict[tuple[str, str], float] = {}
        pcie: dict[tuple[str, str], tuple[float, bool]] = {}
        named: dict[str, set[tuple[str, str]]] = {}      # gpu -> the pods the page names for it
        for family in families:
            for sample in family.samples:
                pod = sample.labels.get("pod")
                if pod:
                    gpu = _gpu(sample.labels)
                    if gpu is not None:
                        named.setdefault(gpu, set()).add((sample.labels.get("namespace", ""), pod))
                # the parser names counter samples "<family>_total" even when the page did not
                name = sample.name.removesuffix("_total") if family.type == "counter" else sample.name
                if name not in GAUGE_FIELDS and name not in PCIE_FIELDS:
                    continue
                gpu = _gpu(sample.labels)
                value = float(sample.value)
                if gpu is None:
                    continue
                if math.isnan(value) or math.isinf(value) or value >= BLANK_THRESHOLD:
                    self.blanks_dropped += 1
                    continue
                if name in GAUGE_FIELDS:
                    metric, scale = GAUGE_FIELDS[name]
                    gauges[(metric, gpu)] = value * scale
                else:
                    pcie[(gpu, PCIE_FIELDS[name])] = (value, family.type == "counter")
        totals = dict(self._totals)      # replaced whole: a scrape thread may be copying the old one
        for key, (value, is_counter) in pcie.items():
            prev = self._prev.get(key)
            totals.setdefault(key, 0.0)
            if prev is not None:
                if is_counter:
                    totals[key] += value - prev[0] if value >= prev[0] else value
                elif value >= 0:
                    totals[key] += value * min(max(0.0, now - prev[1]), self._max_gap)
            self._prev[key] = (value, now)
        # a GPU shared by several pods (time-slicing: one series per pod) has no one owner
        pods = {gpu: next(iter(owners)) for gpu, owners in named.items() if len(owners) == 1}
        self._totals, self._gauges, self._pods = totals, gauges, pods

    def retarget(self, url: str | None) -> None:
        """Scrape another dcgm-exporter from now on. A new pod is a new process whose counters
        start from zero: the next counter sample is taken whole (as after a reset); the byte
        totals already accumulated are kept, so gpulens' own counter never drops."""
        self.url = url
        self._prev = {key: (0.0, t) for key, (_, t) in self._prev.items()}
        self._gauges, self._pods = {}, {}

    def _follow(self) -> bool:
        """Ask `locate` where dcgm-exporter is now; False (and health says why) when nowhere."""
        if self._locate is None:
            return self.url is not None
        finding = self._locate()
        if finding.url != self.url:
            if finding.url:
                log.info("dcgm.found", url=finding.url, reason=finding.reason, previous=self.url or "")
            else:
                log.warning("dcgm.lost", previous=self.url or "", reason=finding.reason)
            self.retarget(finding.url)
        if finding.url is None:
            self._gauges, self._pods = {}, {}
            if finding.state == FAILING:
                self.health.failing(finding.reason, count=False)    # the finder counts its own errors
            elif finding.state == DISABLED:
                self.health.disabled(finding.reason)
            else:
                self.health.waiting(finding.reason)
            return False
        self._found = f"{finding.reason}, scraping {finding.url}"
        return True

    async def poll(self, session) -> None:
        """One scrape of dcgm-exporter; every failure ends up in health, never raised."""
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout)
            async with session.get(self.url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise DcgmParseError(f"dcgm-exporter answered HTTP {resp.status}")
                # to the end: one read() returns only what has arrived, and a page comes in pieces
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > MAX_BODY:
                        raise DcgmParseError(f"dcgm-exporter response larger than {MAX_BODY} bytes")
            self.ingest(body.decode("utf-8", "replace"))
        except (DcgmParseError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            if self.health.view()[1] != reason:
                log.warning("dcgm.scrape_failed", url=self.url, error=reason)
            self._gauges, self._pods = {}, {}     # device gauges go stale; the accumulated counters are kept
            self.health.failing(reason)
            return
        self.health.ok(self._found)

    async def run(self, session, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self._follow():
                await self.poll(session)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
