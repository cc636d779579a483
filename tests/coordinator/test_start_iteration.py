"""One absolute start iteration for every rank, from the ranks' published step counts."""

from __future__ import annotations

import pytest

from gpulens.capture.coordinator.start_iteration import MIN_AHEAD, plan_start
from gpulens.capture.models import StepReading


def test_the_start_is_ahead_of_the_furthest_rank_by_the_fastest_ranks_lead():
    now = 1000.0
    plan = plan_start({0: StepReading(100, now, 10.0), 1: StepReading(103, now, 12.0)}, 5, now=now, lead_s=12.0)
    # rank 1 is at Kineto iteration 102; 12 steps/s for 12 s = 144 steps ahead
    assert plan.iteration == 102 + 144
    assert "rank 1" in plan.detail and "2 of 2 ranks" in plan.detail
    assert plan.window_s == pytest.approx((246 + 5 + 2 - 99) / 10.0)


def test_a_stale_reading_is_projected_to_now():
    plan = plan_start({0: StepReading(100, 990.0, 5.0)}, 3, now=1000.0, lead_s=2.0)
    assert plan.iteration == 99 + 50 + 10


def test_a_slow_job_still_starts_at_least_two_steps_ahead():
    plan = plan_start({0: StepReading(7, 1000.0, 0.01)}, 3, now=1000.0, lead_s=12.0)
    assert plan.iteration == 6 + MIN_AHEAD


def test_with_no_published_count_the_round_up_remains_and_says_why():
    plan = plan_start({0: None, 1: StepReading(0, 1.0, None)}, 3, now=10.0, lead_s=12.0)
    assert plan.iteration is None and "no rank publishes" in plan.detail and "0, 1" in plan.detail


def test_some_ranks_speak_for_a_lockstep_job():
    plan = plan_start({0: None, 1: StepReading(50, 10.0, 1.0)}, 3, now=10.0, lead_s=12.0)
    assert plan.iteration == 49 + 12 and "1 of 2 ranks" in plan.detail


@pytest.mark.parametrize("bad", [None, [], {"count": "1", "at": 1.0}, {"count": 1, "at": float("nan")},
                                 {"count": -5, "at": 1.0}, {"count": 1, "at": 1.0, "per_s": -1},
                                 {"count": True, "at": 1.0}])
def test_a_bad_reading_from_an_agent_is_refused(bad):
    with pytest.raises(ValueError):
        StepReading.from_dict(bad)
