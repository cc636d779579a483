"""Kineto's profiler tick, with real torch 2.13: why the coordinator places wall-clock starts as it does.

Kineto activates a time-based config on the first tick of its 1 s grid at or after start - warm-up
- 1 s and cancels it unless that tick still lies the warm-up before the start ("insufficient time
for warmup"): the room it leaves is the grid's offset from the start. The grid takes the phase of
the last instant the thread slept until: a start, and a window's end that falls between two ticks.
A start on the phase where the last window ended has nearly a whole tick of room; one half a second
off it, half a tick. Without the grid (a tick anywhere), each room would be anywhere in 0-1 s.
"""

from __future__ import annotations

import pytest

from tests.agent.probe_trainer import run_probe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_start_on_the_last_starts_phase_gets_a_whole_tick_of_room():
    result = run_probe("tick_probe.py", 200)
    for why in result["late"]:      # queued again with a new start (tick_probe's docstring): shown, not hidden
        print(f"[tick] fetched too late to measure the grid: {why}")
    first, after_whole, after_half, half_off = result["rooms"]
    assert result["traced"] == [True, True, True, True], result
    assert 0 <= first <= 1.0, result                   # the first config: the grid's phase is its fetch's
    # a start where the last window ended: the tick lands on start - 6 s, a whole tick of room (minus
    # the tick's own lateness: 0.85 leaves 150 ms, more than this machine's ticks were late under load),
    # after a whole-second window and after one whose end (1.5 s) moved the grid to the half second
    assert after_whole >= 0.85 and after_half >= 0.85, result
    # half a second off that phase (a whole second after a window ending on the half): half a tick
    assert 0.3 <= half_off <= 0.55, result
