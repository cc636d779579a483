"""After the builtin endpoint stalled, real Kineto (torch 2.13) still reads each config on time.

A stopped or starved agent lets the endpoint's queue fill; Kineto's sync_send then retries for
10.23 s and, when its tenth try goes through, reports failure and never reads that answer. Without
the endpoint's catch-up rule (ipc_server's module docstring) Kineto reads every later answer one
poll, 5 s, late: a wall-clock config then reaches it too close to its start and is cancelled for
warm-up (the two-node hung-agent test, after node 2's agent resumed). The probe's
`--without-catch-up` shows the 5 s gap.
"""

from __future__ import annotations

import pytest

from tests.agent.probe_trainer import run_probe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_config_after_a_stall_reaches_kineto_at_the_poll_that_fetched_it():
    result = run_probe("stall_probe.py", 150)
    # the stall was the one that traps Kineto: its tenth try went through while it reported failure,
    # and the endpoint left the poll right after it unanswered, once
    assert result["send_failed_lines"] >= 1 and result["unread_answers"] == 1, result
    # so the config handed over after the stall reached Kineto at that poll, not the next one 5 s later
    assert result["gap_s"] < 1.0, result
