"""Per-process counters -> monotonic per-workload series (label pinning, exits, grace, TTL)."""

from __future__ import annotations

from gpulens.exporter.attribution import Workload
from gpulens.exporter.ledger import ProcessLedger, SeriesKey
from gpulens.exporter.probes import ProcessCounters, ProcessKey

A = ProcessKey(100, 5)
B = ProcessKey(101, 6)
POD = Workload("ns", "pod-a", "c", "kubernetes")


def counters(key, launches, **kw):
    return ProcessCounters(key=key, comm="python", cgroup_id=kw.pop("cgroup_id", 77), launches=launches, **kw)


class World:
    """The facts the ledger asks about, settable by the test."""

    def __init__(self):
        self.now = 0.0
        self.alive = {A, B}
        self.workloads = {A.tgid: POD, B.tgid: POD}
        self.gpus = {A.tgid: "0", B.tgid: "0"}
        self.final: dict[ProcessKey, ProcessCounters] = {}

    def ledger(self, **kw):
        return ProcessLedger(clock=lambda: self.now, **kw)

    def update(self, ledger, items, gpu_required=True):
        return ledger.update(items, alive=lambda k: k in self.alive, workload_of=self.workloads.get,
                             gpu_of=self.gpus.get, gpu_required=gpu_required, reread=self.final.get)


def test_processes_of_one_container_sum_into_one_series():
    w = World()
    led = w.ledger()
    w.update(led, [counters(A, 10, sync_seconds=0.5), counters(B, 5, h2d_bytes=7)])
    (key, tot), = led.totals().items()
    assert key == SeriesKey("0", "ns", "pod-a", "c")
    assert (tot.launches, tot.sync_seconds, tot.h2d_bytes) == (15, 0.5, 7)


def test_exit_folds_the_final_read_and_keeps_the_series_monotonic():
    w = World()
    led = w.ledger()
    w.update(led, [counters(A, 10), counters(B, 5)])
    w.alive.discard(A)
    w.final[A] = counters(A, 12)                  # two launches between the map read and the exit
    exited = w.update(led, [counters(A, 10), counters(B, 6)])
    assert exited == [A]
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 18
    w.update(led, [counters(B, 6)])               # A's map entry deleted: still counted
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 18
    assert led.exited_total == 1 and led.tracked == 1


def test_open_call_time_is_not_lost_on_exit():
    """A process killed while blocked: its last read included open-call time the final read lacks."""
    w = World()
    led = w.ledger()
    w.update(led, [counters(A, 1, sync_seconds=3.0)])
    w.alive.discard(A)
    w.final[A] = counters(A, 1, sync_seconds=1.0)
    w.update(led, [counters(A, 1, sync_seconds=3.5)])
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].sync_seconds == 3.5


def test_labels_are_pinned_once_settled():
    w = World()
    led = w.ledger()
    w.update(led, [counters(A, 1)])
    w.workloads[A.tgid] = Workload("other", "moved", "", "kubernetes")
    w.gpus[A.tgid] = "3"
    w.update(led, [counters(A, 2)])
    assert list(led.totals()) == [SeriesKey("0", "ns", "pod-a", "c")]


def test_unsettled_process_is_held_back_until_known_then_appears_in_full():
    w = World()
    led = w.ledger(grace_s=10)
    w.workloads.pop(A.tgid)              # pod not in the index yet
    w.update(led, [counters(A, 5)])
    assert led.totals() == {} and led.pending == 1
    w.now = 3
    w.workloads[A.tgid] = POD
    w.update(led, [counters(A, 9)])
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 9


def test_gpu_unknown_waits_for_grace_then_settles_as_unknown():
    w = World()
    led = w.ledger(grace_s=10)
    w.gpus.pop(A.tgid)
    w.update(led, [counters(A, 5)])
    assert led.totals() == {}
    w.now = 11
    w.update(led, [counters(A, 6)])
    assert list(led.totals()) == [SeriesKey("unknown", "ns", "pod-a", "c")]
    led2 = w.ledger()
    w.update(led2, [counters(A, 6)], gpu_required=False)      # no NVML: no waiting
    assert list(led2.totals()) == [SeriesKey("unknown", "ns", "pod-a", "c")]


def test_process_exiting_before_attribution_uses_its_cgroup_sibling_or_name():
    w = World()
    led = w.ledger()
    w.update(led, [counters(B, 1, cgroup_id=42)])                 # B settled: cgroup 42 is pod-a
    C, D = ProcessKey(102, 7), ProcessKey(103, 8)
    w.update(led, [counters(B, 1, cgroup_id=42), counters(C, 4, cgroup_id=42), counters(D, 3, cgroup_id=99)])
    # C and D died before their first look: C's cgroup is pod-a's (GPU unknowable), D falls back to its name
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 1
    assert led.totals()[SeriesKey("unknown", "ns", "pod-a", "c")].launches == 4
    assert led.totals()[SeriesKey("unknown", "local", "python", "")].launches == 3


def test_retired_series_expire_after_ttl_when_no_process_is_left():
    w = World()
    led = w.ledger(retired_ttl_s=60)
    w.update(led, [counters(A, 10)])
    w.alive.clear()
    w.update(led, [counters(A, 10)])
    w.now = 59
    w.update(led, [])
    assert led.totals()
    w.now = 61
    w.update(led, [])
    assert led.totals() == {}


def test_retired_series_stays_while_a_process_of_it_lives():
    w = World()
    led = w.ledger(retired_ttl_s=60)
    w.update(led, [counters(A, 10), counters(B, 1)])
    w.alive.discard(A)
    w.update(led, [counters(A, 10), counters(B, 1)])
    w.now = 1000
    w.update(led, [counters(B, 2)])
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 12



def test_a_scrape_only_refreshes_counts():
    """alive=None: no exits, no settling, no /proc reads; the next tick does those."""
    w = World()
    led = w.ledger()
    w.update(led, [counters(A, 1)])
    calls = []
    out = led.update([counters(A, 5), counters(B, 9)], alive=None,
                     workload_of=lambda pid: calls.append(pid), gpu_of=lambda pid: calls.append(pid),
                     gpu_required=True)
    assert out == [] and calls == []
    assert led.totals()[SeriesKey("0", "ns", "pod-a", "c")].launches == 5     # B waits for the tick
    assert led.tracked == 1
