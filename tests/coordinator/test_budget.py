"""The trace budget (issue 27): a request is fitted to its per-rank budget before any trainer is
asked, options are priced, and what cannot fit is reduced or refused with the numbers."""

from __future__ import annotations

import pytest

from gpulens.capture.coordinator.budget import (CONSERVATIVE_PER_ITERATION, BudgetRefused, Measured, combined,
                                                measured_from, plan_budget)
from gpulens.capture.coordinator.service import RequestMismatch
from gpulens.capture.dynolog import TraceConfig, build_config
from gpulens.capture.models import Artifact, CaptureOptions, CaptureRequest, ExpectedTarget, Manifest
from gpulens.capture.models.budget import MIB

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job

ONE_MIB_PER_STEP = Measured(per_iteration=1 * MIB, capture_id="c-earlier")


def test_a_generous_budget_leaves_the_request_unchanged():
    req = CaptureRequest(job_id="train", duration_ms=30_000, iterations=5, options=CaptureOptions(record_shapes=True))
    plan = plan_budget(req, default_mb=200, measured=ONE_MIB_PER_STEP)
    assert plan.changes == ()
    assert plan.request.iterations == 5 and plan.request.options == req.options and plan.request.duration_ms == 30_000
    assert plan.request.budget_mb == 200
    assert plan.budget.budget_bytes == 200 * MIB and plan.budget.estimate_bytes == int(5 * 1.6 * MIB)
    assert plan.budget.gpu_buffer_mb == 100 and "measured by capture c-earlier" in plan.budget.basis


def test_a_tight_budget_chooses_fewer_iterations():
    req = CaptureRequest(job_id="train", duration_ms=30_000, iterations=10, budget_mb=4)
    plan = plan_budget(req, measured=ONE_MIB_PER_STEP)
    assert plan.request.iterations == 3             # 80% of 4 MiB holds three 1 MiB steps
    assert plan.budget.estimate_bytes == 3 * MIB <= plan.budget.budget_bytes == 4 * MIB
    assert plan.changes == ("iterations 10 -> 3: ~1.0 MiB each, the budget is 4 MiB",)
    assert plan.budget.gpu_buffer_mb == 4           # at least one CUPTI buffer


def test_a_time_window_is_shortened_to_fit():
    req = CaptureRequest(job_id="train", duration_ms=2000, budget_mb=8)
    plan = plan_budget(req, measured=Measured(per_second=10 * MIB, capture_id="c-x"))
    assert plan.request.duration_ms == 640 and "window 2000 ms -> 640 ms" in plan.changes[0]


def test_options_that_cannot_fit_are_dropped_costliest_first_with_the_reason():
    opts = CaptureOptions(with_stack=True, record_shapes=True, with_flops=True)
    req = CaptureRequest(job_id="train", duration_ms=30_000, iterations=4, options=opts, budget_mb=4)
    plan = plan_budget(req, measured=ONE_MIB_PER_STEP)
    # 1 MiB x 2.5 x 1.6 x 1.1 = 4.4 MiB > 3.2: with_stack goes; 1.76 MiB fits once
    assert plan.request.options == CaptureOptions(with_stack=False, record_shapes=True, with_flops=True)
    assert plan.request.iterations == 1
    assert plan.changes[0].startswith("with_stack dropped: with it not even 1 iteration fits the 4 MiB budget")
    assert "iterations 4 -> 1" in plan.changes[1]


def test_a_capture_that_cannot_fit_even_bare_is_refused_with_the_numbers():
    req = CaptureRequest(job_id="train", duration_ms=30_000, iterations=2, budget_mb=1,
                         options=CaptureOptions(with_stack=True))
    with pytest.raises(BudgetRefused) as exc:
        plan_budget(req, measured=Measured(per_iteration=2 * MIB, capture_id="c-big"))
    msg = str(exc.value)
    assert "1 iteration is estimated at 2.0 MiB per rank" in msg and "1 MiB budget" in msg
    assert "measured by capture c-big" in msg and "--budget-mb" in msg


def test_without_a_measurement_the_estimate_is_the_conservative_start():
    plan = plan_budget(CaptureRequest(job_id="train", duration_ms=30_000, iterations=50))
    assert plan.request.iterations == int(0.8 * 200 * MIB // CONSERVATIVE_PER_ITERATION) == 20
    assert "conservative" in plan.budget.basis


def test_the_measurement_is_the_largest_rank_per_step_without_its_options():
    def art(rank: int, uncompressed: int, steps: int) -> Artifact:
        return Artifact(f"rank-{rank}", rank, rank, "n", "p", 10 + rank, 0, f"file:///a/rank-{rank}.json.gz", 100,
                        "0" * 64, None, iterations={"requested": 4, "roundup": 1, "first": 1, "last": 4,
                                                    "optimizer_steps": steps, "stepped": True},
                        sizes={"budget": None, "estimate": None, "uncompressed": uncompressed, "stored": 100,
                               "encoding": "gzip", "gpu_buffer_mb": None, "stopped_early": None})
    m = Manifest("c-prev", "train", 0, 0.0, 30_000, [ExpectedTarget("rank-0", 0, 0, "p", "n")],
                 artifacts=[art(0, 8 * MIB, 4), art(1, 16 * MIB, 4)])
    req = CaptureRequest(job_id="train", duration_ms=30_000, iterations=4, options=CaptureOptions(record_shapes=True))
    got = measured_from(m, req)
    assert got.per_iteration == pytest.approx(4 * MIB / 1.6) and got.capture_id == "c-prev"


def test_a_hang_captures_documents_are_no_measure_of_a_trace():
    """Issue 45: a hang capture archives a few MB of evidence per rank whatever its 2 s 'window';
    counted as trace bytes per second they would shrink every later wall capture's window."""
    doc = Artifact("rank-0", 0, 0, "n", "p", 10, 0, "file:///a/rank-0.hang.json", 50 * MIB, "0" * 64, None,
                   kind="hang_evidence", sizes={"budget": None, "estimate": None, "uncompressed": 50 * MIB,
                                                "stored": 50 * MIB, "encoding": "identity", "gpu_buffer_mb": None,
                                                "stopped_early": None})
    m = Manifest("c-hang", "train", 0, 0.0, 2000, [ExpectedTarget("rank-0", 0, 0, "p", "n")], artifacts=[doc])
    assert measured_from(m, CaptureRequest(job_id="train", duration_ms=2000, kind="hang")) is None
    assert measured_from(m, CaptureRequest(job_id="train", duration_ms=2000)).per_second == 25 * MIB   # as a trace


def test_the_kineto_config_carries_the_gpu_buffer_cap():
    text = build_config(TraceConfig("/t/c/rank-0.json", 500, max_gpu_buffer_mb=4))
    assert "ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB=4" in text.splitlines()
    assert "ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB" not in build_config(TraceConfig("/t/c/rank-0.json", 500))


async def test_the_coordinator_refuses_before_dispatch_and_sends_the_budget_with_each_dispatch(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    double = AgentDouble("node-a", AGENT_TOKEN)
    async with RunningAgent(double) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        with pytest.raises(RequestMismatch) as exc:     # the server answers it 400 with the field
            c.start(CaptureRequest(job_id="train", duration_ms=30_000, iterations=2, budget_mb=1))
        assert exc.value.field == "budget_mb" and "8.0 MiB" in str(exc.value)
        assert c.captures == {} and double.dispatches == []
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=2000, budget_mb=16))
        await c.wait(rec.capture_id)
        await c.close()
    d = double.captures[rec.capture_id]["rank-0"].dispatch
    assert d.budget is not None and d.budget.budget_bytes == 16 * MIB and d.budget.gpu_buffer_mb == 8
    assert d.duration_ms == rec.request.duration_ms == 800 < 2000      # 80% of 16 MiB at 16 MiB/s
    m = Manifest.from_json(open(rec.manifest_uri.removeprefix("file://")).read())
    assert m.request["budget"]["budget_bytes"] == 16 * MIB
    assert m.request["budget"]["changes"] == ["window 2000 ms -> 800 ms: ~16.0 MiB per second, the budget is 16 MiB"]


def test_every_measured_capture_counts_each_kind_its_own_largest():
    """Alternating kinds (issue 43): the newest capture being a wall one says nothing of an iteration."""
    got = combined([Measured(per_iteration=1 * MIB, capture_id="c-it-small"),
                    Measured(per_second=3 * MIB, capture_id="c-wall"),
                    Measured(per_iteration=2 * MIB, capture_id="c-it-big"),
                    Measured(per_second=1 * MIB, capture_id="c-wall-newest")])
    assert got.per_iteration == 2 * MIB and got.per_second == 3 * MIB and got.captures == 4
    it = plan_budget(CaptureRequest(job_id="train", duration_ms=30_000, iterations=4), measured=got)
    assert "per iteration measured by capture c-it-big (largest of 4 measured captures)" in it.budget.basis
    wall = plan_budget(CaptureRequest(job_id="train", duration_ms=1000), measured=got)
    assert "per second measured by capture c-wall (" in wall.budget.basis
    only_wall = combined([Measured(per_second=3 * MIB, capture_id="c-wall")])
    plan = plan_budget(CaptureRequest(job_id="train", duration_ms=30_000, iterations=4), measured=only_wall)
    assert "conservative: no iteration capture of this job measured yet" in plan.budget.basis
    assert combined([]) is None
