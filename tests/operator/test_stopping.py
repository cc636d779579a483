"""The operator's own loops outlive kopf's shutdown (capture/operator/stopping.py).

kopf's `run_tasks` (what `kopf.operator` ends with) cancels every task of the loop that appeared
after kopf started. The certificate reloader, the resync and the Lease renewal start before kopf
and wait on the stop event interval after interval; a wait begun while kopf runs must not be one of
those tasks, or a plain SIGTERM ends the operator with exit 1 and a CancelledError traceback (seen
under load in test_command.py: the loops had passed one interval before the stop). These run kopf's
real shutdown code against the real loops."""

from __future__ import annotations

import asyncio
import time

from kopf._cogs.aiokits import aiotasks
from kopf._core.reactor.running import run_tasks

from gpulens.capture.operator.leadership import LeaseElector
from gpulens.capture.operator.stopping import stopped_within
from gpulens.capture.operator.webhook import reload_certificates, tls_context

from .tls import make_certs


INTERVAL_S = 6.0     # more than nothing, and a wait begun after kopf started outlasts its 5 s of grace


class Renewal(LeaseElector):
    """The Lease renewal loop alone (`keep`): every renewal succeeds, no API."""

    def __init__(self):
        self.identity, self.observed_leader, self.duration_s = "op-1", "op-1", 15.0
        self.renew_period_s, self.clock, self.last_renewed, self.renewals = INTERVAL_S, time.monotonic, 0.0, 0

    def try_acquire(self) -> bool:
        self.renewals += 1
        self.last_renewed = self.clock()
        return True


async def test_the_reloader_and_the_lease_renewal_end_cleanly_after_kopfs_shutdown(tmp_path):
    """Both loops start before kopf, as in `serve`; each begins a new wait while kopf runs; kopf
    stops (its root task ends), waits 5 s for the tasks born since it started, cancels the rest, and
    only then does `serve` set the stop event. Both loops must return, not raise."""
    _, cert, key = make_certs(tmp_path)
    stop, lost, renewal = asyncio.Event(), asyncio.Event(), Renewal()
    loops = [asyncio.create_task(reload_certificates(tls_context(str(cert), str(key)), str(cert), str(key), stop,
                                                     interval_s=INTERVAL_S)),
             asyncio.create_task(renewal.keep(stop, lost))]
    existing = await aiotasks.all_tasks()              # kopf.operator starts here
    await asyncio.sleep(INTERVAL_S + 0.5)               # each loop has begun a wait since
    await run_tasks([asyncio.create_task(asyncio.sleep(0))], ignored=existing)
    stop.set()                                           # serve's `finally`
    assert await asyncio.gather(*loops, return_exceptions=True) == [None, None]
    assert renewal.renewals == 1 and not lost.is_set()


async def test_stopped_within_says_which_came_first():
    stop = asyncio.Event()
    assert await stopped_within(stop, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert await stopped_within(stop, 30) is True
    assert await stopped_within(stop, 30) is True       # already set: at once
