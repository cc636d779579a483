"""The start rules (capture/agent/start_rules.py, issue 47) on the records the pipeline keeps: a
wall-clock config holds its process only until its start, an empty `.tmp` (what Kineto leaves when it
cancels a config for warm-up) never holds a rank past the config's window, a refusal Kineto's polls
showed frees the rank at once, an iteration config that can no longer be sent in time says why,
naming the config that held its process rather than pointing at the lead, and a wall-clock one goes
out on Kineto's own clock instead (`late_start`), held and judged by that clock."""

from __future__ import annotations

import time

import pytest

from gpulens.capture.agent import start_rules
from gpulens.capture.agent.steps import StepLog
from gpulens.capture.agent.store import TargetRecord
from gpulens.capture.models import Dispatch, TargetStatus

NOW = 1_800_000_000.0


def record(tmp_path, target="rank-0", capture="c-1", **kw) -> TargetRecord:
    d = {"job_id": "train", "attempt": 0, "rank": 0, "duration_ms": 1000, "activities": ["cpu_op"],
         "deadline": NOW + 60, "archive_prefix": "file:///tmp/archive/x", **kw}
    rec = TargetRecord(capture, target, d, TargetStatus(target), accepted_at=NOW)
    rec.watch_path = str(tmp_path / f"{capture}-{target}_41.json")
    rec.queued_at = NOW
    return rec


def steps_at(count: int) -> StepLog:
    return StepLog(latest=count, latest_at=NOW, steps=(count,), times=(NOW,))


def never(rec, now, steps=None):
    return start_rules.never_written(rec, steps, now, [], poll_s=5.0, write_s=60.0)


def test_a_wall_config_holds_its_process_until_two_ticks_past_its_start(tmp_path):
    rec = record(tmp_path, start_time_ms=int((NOW + 20) * 1000))
    assert start_rules.holds_process(rec, NOW + 10)            # pending in Kineto: a new config would be ignored
    assert start_rules.holds_process(rec, NOW + 21)
    assert not start_rules.holds_process(rec, NOW + 22.5)      # activated (busy) or cancelled: a new one is taken


def test_an_iteration_config_holds_its_process_past_any_time(tmp_path):
    rec = record(tmp_path, iterations=3, start_iteration=500)
    assert start_rules.holds_process(rec, NOW + 3600)


def test_a_refusal_kineto_polls_showed_frees_the_process_at_once(tmp_path):
    rec = record(tmp_path, start_time_ms=int((NOW + 20) * 1000))
    rec.kineto_refusal = "idle past its start"
    assert not start_rules.holds_process(rec, NOW + 1)
    assert "never ran" in never(rec, NOW + 1)


def test_an_empty_tmp_holds_a_wall_config_only_until_its_window_and_write_time_passed(tmp_path):
    rec = record(tmp_path, start_time_ms=int((NOW + 20) * 1000))
    open(rec.watch_path + ".tmp", "w").close()                 # Kineto opened its logger, then cancelled
    assert never(rec, NOW + 30) is None                        # the window (+ its write) may still be running
    why = never(rec, NOW + 20 + 1 + 60 + 1)
    assert why is not None and "long past its window" in why and "empty .tmp" in why


def test_a_tmp_being_written_holds_whatever_the_clock_says(tmp_path):
    rec = record(tmp_path, start_time_ms=int((NOW + 20) * 1000))
    with open(rec.watch_path + ".tmp", "w") as f:
        f.write('{"schemaVersion": 1,')                       # Kineto writes only once the collection ended
    assert start_rules.tmp_being_written(rec.watch_path)
    assert never(rec, NOW + 3600) is None


def test_kinetos_own_start_is_judged_from_the_fetch(tmp_path):
    rec = record(tmp_path)
    rec.delivered_at = NOW + 3
    assert never(rec, NOW + 3 + 7 + 1 + 59) is None
    assert "due to start by" in never(rec, NOW + 3 + 7 + 1 + 61)


def test_an_iteration_tmp_means_it_started(tmp_path):
    rec = record(tmp_path, iterations=3, start_iteration=100)
    open(rec.watch_path + ".tmp", "w").close()
    assert never(rec, NOW + 3600, steps_at(10_000)) is None


def test_a_wall_start_too_close_to_meet_is_a_late_start_naming_the_holder_never_a_missed_start(tmp_path):
    spec = Dispatch.from_dict(record(tmp_path, start_time_ms=int((NOW + 20) * 1000)).dispatch)
    assert start_rules.late_start(spec, NOW + 5) is None                     # 15 s left: Kineto has time
    alone = start_rules.late_start(spec, NOW + 9)                            # 11 s left: < 12 s
    assert alone is not None and "--wall-start-lead-s" in alone and "Kineto's own clock" in alone
    holder = record(tmp_path, target="rank-0", capture="c-0")
    held = start_rules.late_start(spec, NOW + 9, holder)
    assert "capture c-0 target rank-0" in held and "--wall-start-lead-s" not in held
    # a wall-clock config is still the rank's evidence: never refused as missed
    assert start_rules.missed_before(spec, None, NOW + 9, holder) is None
    assert start_rules.missed_before(spec, None, NOW + 3600) is None


def test_a_late_started_config_is_judged_and_held_on_kinetos_own_clock(tmp_path):
    rec = record(tmp_path, start_time_ms=int((NOW + 20) * 1000))
    rec.late_start = "too close"
    rec.delivered_at = NOW + 30                 # fetched well after the chosen instant (an agent restarted)
    # the chosen instant's window (20 s + 1 s + 60 s write) is over, but Kineto's own start is 37 s
    assert never(rec, NOW + 85) is None
    assert "due to start by" in never(rec, NOW + 37 + 1 + 61)
    # the chosen instant + 2 ticks has passed, but the config went out on Kineto's own clock: it holds
    # its process like any such config, until its trace comes or never_written says it cannot
    assert start_rules.holds_process(rec, NOW + 25) and start_rules.holds_process(rec, NOW + 60)
    rec.late_start = None
    assert not start_rules.holds_process(rec, NOW + 25)


def test_a_rank_held_past_the_start_iteration_is_told_so_not_sent_to_the_lead(tmp_path):
    spec = Dispatch.from_dict(record(tmp_path, iterations=3, start_iteration=500).dispatch)
    assert start_rules.missed_before(spec, steps_at(400), NOW) is None
    holder = record(tmp_path, capture="c-0")
    held = start_rules.missed_before(spec, steps_at(502), NOW, holder)
    assert "still held capture c-0" in held and "--start-lead-s" not in held
    assert "--start-lead-s" in start_rules.missed_before(spec, steps_at(502), NOW)


@pytest.mark.parametrize("traced,expected", [((502, 504), None), ((503, 505), "started at its next step"), (None, None)])
def test_misalignment_is_the_first_traced_step_against_the_chosen_iteration(tmp_path, traced, expected):
    spec = Dispatch.from_dict(record(tmp_path, iterations=3, start_iteration=500).dispatch)
    got = start_rules.misaligned(spec, traced)
    assert (got is None) if expected is None else (expected in got)


def test_a_wall_traces_window_is_its_collection_beside_the_chosen_instant(tmp_path):
    spec = Dispatch.from_dict(record(tmp_path, start_time_ms=int((NOW + 20) * 1000)).dispatch)
    w = start_rules.window_of(spec, {"window_start": NOW + 20.4, "window_end": NOW + 21.4})
    assert w == {"start": NOW + 20.4, "end": NOW + 21.4, "chosen_start": NOW + 20, "start_skew_s": 0.4}
    late = start_rules.window_of(spec, {"window_start": NOW + 31.0, "window_end": NOW + 32.0}, "too close")
    assert late["late_start"] == "too close" and late["start_skew_s"] == 11.0
    it = Dispatch.from_dict(record(tmp_path, iterations=3).dispatch)
    assert start_rules.window_of(it, {"window_start": 1.0, "window_end": 2.0}) is None


def test_the_dispatch_refuses_a_start_time_that_is_not_an_epoch_millisecond():
    bad = {"job_id": "j", "attempt": 0, "rank": 0, "duration_ms": 1, "activities": ["cpu_op"], "deadline": time.time(),
           "archive_prefix": "file:///a", "start_time_ms": 20_000}          # 20 s: a relative lead, not an instant
    with pytest.raises(Exception):
        Dispatch.from_dict(bad)
