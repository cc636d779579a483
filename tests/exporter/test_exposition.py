"""The /metrics cache: bytes encoded at the tick, identical to the collector's own exposition."""

from __future__ import annotations

import gzip

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

from gpulens.exporter.catalogue import load_catalogue
from gpulens.exporter.collector import GpulensCollector, ScrapeData, SourceView
from gpulens.exporter.exposition import ExpositionCache
from gpulens.exporter.ledger import SeriesKey, Totals

OM = "application/openmetrics-text; version=1.0.0"
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def data(n: int, launches: int = 10) -> ScrapeData:
    d = ScrapeData(node="n1", workload_totals={
        SeriesKey("0", "ns", f'pod-{i}"\\\n', "c", "job"): Totals(launches=launches * i, graph_launches=i, sync_calls=3,
                                                                  sync_seconds=0.1 * i, h2d_bytes=1 << 40)
        for i in range(n)})
    d.sources = [SourceView("ebpf", True, "ok", "probing 1 driver library", 0)]
    return d


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def setup(n: int = 50):
    current = {"d": data(n)}
    collector = GpulensCollector(lambda: current["d"], load_catalogue(), clock=lambda: 0.0)
    list(collector.collect())      # from now on every collection carries the same scrape duration (0)
    registry = CollectorRegistry()
    registry.register(collector)
    clock = Clock()
    cache = ExpositionCache(collector.collect, tick_interval_s=2.0, clock=clock)
    return current, registry, cache, clock


def test_cached_bodies_are_byte_identical_to_the_collectors_exposition():
    _cur, registry, cache, _clock = setup()
    assert cache.refresh()
    text = cache.body("", False)
    assert text.data == generate_latest(registry)          # same snapshot, same bytes
    assert b'pod="pod-0\\"\\\\\\n"' in text.data           # label escaping went through the real encoder
    om = cache.body(OM, False)
    assert om.content_type.startswith("application/openmetrics-text")
    assert om.data == om_generate_latest(registry) and om.data.endswith(b"# EOF\n")
    gz = cache.body(PROMETHEUS_ACCEPT, True)
    assert gz.gzipped and gzip.decompress(gz.data) == om_generate_latest(registry)


def test_a_scrape_serves_the_ticks_bytes_not_a_fresh_collection():
    cur, registry, cache, clock = setup()
    cache.refresh()
    first = cache.body("", False).data
    made = cache.encodings
    cur["d"] = data(50, launches=999)                       # counts move; no tick yet
    clock.t += 1.0
    assert cache.body("", False).data == first              # served from the cache
    assert cache.encodings == made                          # and nothing was encoded for it
    clock.t += 1.0
    cache.refresh(force=True)                               # the next tick
    after = cache.body("", False).data
    assert after != first and after == generate_latest(registry)


def test_a_stale_cache_is_re_encoded_in_line():
    cur, registry, cache, clock = setup()
    cache.refresh()
    old = cache.body("", False).data
    cur["d"] = data(50, launches=7)
    clock.t += cache.max_age_s + 0.1                        # the ticks stopped (or the scraper is irregular)
    fresh = cache.body("", False)
    assert fresh.data != old and fresh.data == generate_latest(registry) and fresh.made_at == clock.t


def test_the_tick_encodes_once_per_scrape_interval_not_every_tick():
    _cur, _reg, cache, clock = setup(5)
    cache.refresh()
    for t in (100.0, 115.0, 130.0):                         # Prometheus every 15 s
        clock.t = t
        cache.body("", False)
    encoded = []
    for tick in range(1, 16):                               # ticks every 2 s until the next scrape (145)
        clock.t = 130.0 + 2 * tick - 1
        if cache.refresh():
            encoded.append(clock.t)
    assert encoded == [143.0]                               # the tick just before the scrape at 145
    clock.t = 145.0
    body = cache.body("", False)
    assert body.made_at == 143.0                            # 2 s old at most, from the cache


def test_with_no_scrapes_yet_every_tick_encodes():
    _cur, _reg, cache, clock = setup(5)
    for _ in range(3):
        clock.t += 2
        assert cache.refresh()
