"""/metrics bodies encoded at the discovery tick and served as cached bytes.

At 1,000 processes a scrape spent two thirds of its ~100 ms in prometheus_client's text encoding,
although the counts only move at each tick. So the tick collects once (the same families the
registry's collector yields) and encodes them with prometheus_client's own encoders; a scrape then
hands out those bytes (and their gzip) in microseconds, byte-identical to what the collector's
exposition would have produced from the same snapshot.

CPU stays at one encoding per scrape, not per tick: the tick encodes only when the next scrape is
due before the following tick (the scrape interval is learnt from the scrapes themselves), and a
scrape that finds the cache older than `max_age_s` (irregular scrapers) encodes in line, so a body
is never older than that.
"""

from __future__ import annotations

import gzip
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

__all__ = ["ExpositionCache", "Body", "TEXT", "frozen"]

#: the default format (no or an unknown Accept header)
TEXT = CONTENT_TYPE_PLAIN_0_0_4
Encoder = Callable[[object], bytes]


class _Frozen:
    """A collector over families already built (what generate_latest reads)."""

    def __init__(self, families: list):
        self._families = families

    def collect(self) -> Iterable:
        return iter(self._families)


def frozen(families: list) -> _Frozen:
    return _Frozen(families)


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str
    gzipped: bool
    made_at: float            # clock time of the snapshot the bytes encode


class ExpositionCache:
    """`refresh()` after each tick; `body()` per scrape. Thread-safe (both run in worker threads)."""

    def __init__(self, collect: Callable[[], list], *, tick_interval_s: float, max_age_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._collect = collect
        self._tick = tick_interval_s
        self.max_age_s = max_age_s if max_age_s is not None else 2 * tick_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._families: list | None = None
        self._made_at = 0.0
        self._bodies: dict[tuple[str, bool], bytes] = {}
        # formats asked for so far (content type, gzip) -> prometheus_client's encoder for it
        self._wanted: dict[tuple[str, bool], Encoder] = {(TEXT, False): generate_latest}
        self._scrapes: deque[float] = deque(maxlen=8)
        #: encodings made (tick + in line): tests and the bench read it
        self.encodings = 0

    # ---- tick side ---------------------------------------------------------------------------

    def scrape_interval(self) -> float | None:
        """Median gap between recent scrapes, or None before there are three."""
        if len(self._scrapes) < 3:
            return None
        s = list(self._scrapes)
        return statistics.median(b - a for a, b in zip(s, s[1:]))

    def due(self, now: float) -> bool:
        """Whether the tick at `now` should encode: no body yet, or the next scrape is expected
        before the following tick (or cannot be predicted)."""
        if self._families is None:
            return True
        interval = self.scrape_interval()
        if interval is None or not self._scrapes:
            return True
        next_scrape = self._scrapes[-1] + interval
        # the next scrape comes before the following tick, and no body was made for it yet (an
        # overdue scrape finds a body older than max_age_s and encodes in line)
        return next_scrape <= now + self._tick and self._made_at < next_scrape - self._tick

    def refresh(self, *, force: bool = False) -> bool:
        """Collect and encode now if due (or forced); True when it did."""
        now = self._clock()
        with self._lock:
            if not (force or self.due(now)):
                return False
            wanted = dict(self._wanted)
        self._rebuild(now, wanted)
        return True

    def _rebuild(self, now: float, wanted: dict[tuple[str, bool], Encoder]) -> None:
        families = list(self._collect())
        bodies = {key: self._encode(families, enc, key[1]) for key, enc in wanted.items()}
        with self._lock:
            self._families, self._made_at, self._bodies = families, now, bodies

    def _encode(self, families: list, encoder: Encoder, gzipped: bool) -> bytes:
        self.encodings += 1
        data = encoder(_Frozen(families))
        return gzip.compress(data, compresslevel=6, mtime=0) if gzipped else data

    # ---- scrape side -------------------------------------------------------------------------

    def body(self, accept: str = "", gzipped: bool = False) -> Body:
        """The cached bytes for the format `accept` negotiates (prometheus_client's choice),
        encoded now if this format was never asked for or the cache is older than max_age_s."""
        encoder, content_type = choose_encoder(accept)
        key = (content_type, gzipped)
        now = self._clock()
        with self._lock:
            self._scrapes.append(now)
            self._wanted.setdefault(key, encoder)
            encoder = self._wanted[key]
            stale = self._families is None or now - self._made_at > self.max_age_s
            data = None if stale else self._bodies.get(key)
            families, made_at = self._families, self._made_at
        if stale:
            self._rebuild(now, {key: encoder})
            with self._lock:
                data, made_at = self._bodies[key], self._made_at
        elif data is None:
            data = self._encode(families, encoder, gzipped)
            with self._lock:
                if self._made_at == made_at:
                    self._bodies[key] = data
        return Body(data, content_type, gzipped, made_at)
