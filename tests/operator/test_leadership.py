"""Lease-based leader election: the pure decision, and two electors racing through the test API
server (which enforces resourceVersion on PUT like the real one), with an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from gpulens.capture.operator.leadership import LeaseElector, _fmt, decide

NS, LEASE = "gpulens-system", "gl-gpulens-operator"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def lease(holder: str, renewed: float, duration: int = 15) -> dict:
    return {"spec": {"holderIdentity": holder, "renewTime": _fmt(renewed), "acquireTime": _fmt(renewed - 100),
                     "leaseDurationSeconds": duration, "leaseTransitions": 3}}


def test_decide():
    now = 1_800_000_000.0
    assert decide(None, "a", now, 15).action == "create"
    assert decide(lease("a", now - 5), "a", now, 15).action == "update"           # renew own
    d = decide(lease("b", now - 5), "a", now, 15)
    assert (d.action, d.leader) == ("follow", "b")                                # b is alive
    d = decide(lease("b", now - 16), "a", now, 15)
    assert (d.action, d.leader) == ("update", "a") and d.spec["leaseTransitions"] == 4   # b expired
    assert decide(lease("", now), "a", now, 15).action == "update"                 # released
    broken = {"spec": {"holderIdentity": "b", "renewTime": "yesterday-ish"}}
    assert decide(broken, "a", now, 15).action == "update"                         # unreadable: take it


def _electors(apiserver, clock):
    a = LeaseElector(apiserver.api_client(), NS, LEASE, "op-a", 15, 5, clock=clock)
    b = LeaseElector(apiserver.api_client(), NS, LEASE, "op-b", 15, 5, clock=clock)
    return a, b


def test_only_one_replica_leads_and_the_other_takes_over_after_expiry(apiserver):
    clock = Clock()
    a, b = _electors(apiserver, clock)
    assert a.try_acquire() is True
    assert b.try_acquire() is False and b.observed_leader == "op-a"
    clock.t += 10
    assert a.try_acquire() is True and b.try_acquire() is False                  # renewed in time
    clock.t += 16                                                                 # a stops renewing
    assert b.try_acquire() is True
    assert a.try_acquire() is False and a.observed_leader == "op-b"


def test_a_stale_write_loses_the_race(apiserver):
    """Both read an expired lease; the API server lets only the first replace through (409)."""
    clock = Clock()
    a, b = _electors(apiserver, clock)
    assert a.try_acquire()
    clock.t += 16
    stale = b._read()
    assert b.try_acquire() is True
    # a acts on the state it read before b's write: its resourceVersion is stale now.
    from kubernetes.client.rest import ApiException
    body = {**stale, "spec": {**stale["spec"], "holderIdentity": "op-a"}}
    with pytest.raises(ApiException) as err:
        a.api.replace_namespaced_lease(LEASE, NS, body, _preload_content=False)
    assert err.value.status == 409


def test_release_hands_over_at_once(apiserver):
    clock = Clock()
    a, b = _electors(apiserver, clock)
    assert a.try_acquire()
    a.release()
    assert b.try_acquire() is True                                                # no waiting for expiry


def test_api_faults_are_not_leadership(apiserver):
    import kmock

    clock = Clock()
    a, _ = _electors(apiserver, clock)
    apiserver.server[kmock.resource("coordination.k8s.io/v1/leases")] << 500
    assert a.try_acquire() is False and a.observed_leader is None


async def test_keep_gives_up_when_another_replica_holds_the_lease(apiserver):
    clock = Clock()
    a, b = _electors(apiserver, clock)
    a.renew_period_s = 0.01
    assert a.try_acquire()
    clock.t += 16
    assert b.try_acquire()                          # b took over while a was stuck
    stop, lost = asyncio.Event(), asyncio.Event()
    await asyncio.wait_for(a.keep(stop, lost), 30)
    assert lost.is_set() and stop.is_set()


async def test_acquire_waits_as_a_follower_until_stopped(apiserver):
    clock = Clock()
    a, b = _electors(apiserver, clock)
    assert a.try_acquire()
    b.renew_period_s = 0.01
    stop = asyncio.Event()
    task = asyncio.create_task(b.acquire(stop))
    await asyncio.sleep(0.1)
    assert not task.done()
    stop.set()
    assert await asyncio.wait_for(task, 30) is False
