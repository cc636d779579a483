"""KinetoWatch reads what Kineto did with a fetched config from its later polls (bit 2 = idle),
through the real endpoint and real datagrams: started / finished for a trace that ran, refused
(not_started) for a time-based config still idle 8 s after the fetch, refused (another_pending)
for a config fetched while an earlier iteration-based one waits unstarted, and never a refusal for
an iteration-based config that is only waiting for its iteration."""

from __future__ import annotations

from gpulens.capture.dynolog import KinetoEndpoint, build_config, ipcwire, TraceConfig
from gpulens.capture.dynolog.kineto_watch import KinetoWatch, is_iteration_config

IDLE, BUSY = 3, 1          # what torch 2.13 sends (the old events bit 1 is always set)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def config(name: str, iterations: int = 0) -> str:
    return build_config(TraceConfig(f"/t/{name}.json", 200, iterations=iterations, iteration_roundup=50))


def setup():
    clock, said = Clock(), []
    ep = KinetoEndpoint("/tmp/unused-socket-dir", on_kineto=said.append, clock=clock)
    return ep, clock, said


def poll(ep: KinetoEndpoint, config_type: int, pid: int = 41) -> str:
    reply = ep.handle(ipcwire.pack_request(ipcwire.Request(config_type, 7, (pid, 1))))
    return ipcwire.unpack(reply)[1].decode()


def test_a_trace_that_runs_is_started_then_finished_never_refused():
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(config("a"), [41], 7, trace_id="11")
    assert "ACTIVITIES_LOG_FILE=/t/a.json" in poll(ep, IDLE)      # fetched
    clock.t += 5
    poll(ep, BUSY)
    clock.t += 5
    poll(ep, BUSY)
    assert [(o.kind, o.trace_id) for o in said] == [("started", "11")]
    clock.t += 5
    poll(ep, IDLE)
    clock.t += 5
    poll(ep, IDLE)
    assert [(o.kind, o.cause) for o in said] == [("started", None), ("finished", None)]


def test_a_time_config_still_idle_after_the_activation_window_was_dropped():
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(config("a"), [41], 7, trace_id="12")
    poll(ep, IDLE)
    clock.t += 5                       # the next poll: activation may still be under way, no verdict yet
    poll(ep, IDLE)
    assert said == []
    clock.t += 3
    poll(ep, IDLE)
    assert [(o.kind, o.cause, o.trace_id, o.pid) for o in said] == [("refused", "not_started", "12", 41)]
    assert "dropped it" in said[0].describe() and "insufficient time for warmup" in said[0].describe()
    clock.t += 5
    poll(ep, IDLE)
    assert len(said) == 1              # said once


def test_an_iteration_config_waiting_idle_is_not_refused_but_blocks_the_next_one():
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(config("it", iterations=5), [41], 7, trace_id="21")
    poll(ep, IDLE)
    for _ in range(10):                # 50 s of idle polls: it waits for its start iteration
        clock.t += 5
        poll(ep, IDLE)
    assert said == []
    ep.trigger(config("b"), [41], 7, trace_id="22")
    assert "/t/b.json" in poll(ep, IDLE)
    assert [(o.kind, o.cause, o.trace_id, o.held_trace_id) for o in said] == [("refused", "another_pending", "22", "21")]
    assert "another profile request is pending" in said[0].describe()
    clock.t += 5
    poll(ep, BUSY)                     # the iteration trace starts: it is the one Kineto held
    assert said[-1].kind == "started" and said[-1].trace_id == "21"


def test_a_second_time_config_behind_an_unjudged_one_is_not_called_refused_at_fetch():
    """Only an iteration config is known to sit in Kineto's slot; a time-based one may already be
    gone (dropped silently), so the next config is judged by its own polls."""
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(config("a"), [41], 7, trace_id="41")
    poll(ep, IDLE)
    clock.t += 5
    ep.trigger(config("b"), [41], 7, trace_id="42")
    assert "/t/b.json" in poll(ep, IDLE)
    assert said == []
    clock.t += 5
    poll(ep, BUSY)
    assert [(o.kind, o.trace_id) for o in said] == [("started", "41")]


def test_other_processes_polls_say_nothing_about_this_one():
    ep, clock, said = setup()
    poll(ep, IDLE, pid=41)
    poll(ep, IDLE, pid=42)
    ep.trigger(config("a"), [41], 7, trace_id="31")
    poll(ep, IDLE, pid=41)
    clock.t += 10
    poll(ep, BUSY, pid=42)
    poll(ep, IDLE, pid=42)
    assert said == []
    ep.collect_garbage()               # keepalive 60 s not reached: nothing forgotten
    clock.t += 61
    ep.collect_garbage()
    poll(ep, IDLE, pid=41)             # a new registration: its old fetch is forgotten with it
    assert said == []


def test_iteration_configs_are_told_apart_by_kinetos_rule():
    assert is_iteration_config(config("it", iterations=5))
    assert not is_iteration_config(config("t"))
    assert not is_iteration_config("PROFILE_START_ITERATION=0\nACTIVITIES_ITERATIONS=0")
    assert not is_iteration_config("PROFILE_START_ITERATION=-1\nACTIVITIES_ITERATIONS=5")
    assert not is_iteration_config("PROFILE_START_ITERATION=x\nACTIVITIES_ITERATIONS=5")


def test_the_watch_alone_keeps_at_most_a_few_held_configs_per_process():
    said, clock = [], Clock()
    w = KinetoWatch(said.append, clock=clock)
    w.on_fetch("k", 7, 41, "1", config("it", iterations=5))
    for i in range(20):                # each one refused: the first still holds Kineto's slot
        w.on_fetch("k", 7, 41, str(i + 2), config(f"b{i}"))
    assert len(said) == 20 and all(o.held_trace_id == "1" for o in said)
    assert len(w._held["k"]) == 1


def timed_config(name: str, lead_s: float) -> str:
    """A wall-clock config with the explicit start the coordinator chooses (issue 47)."""
    import time
    return build_config(TraceConfig(f"/t/{name}.json", 1000, start_time_ms=int((time.time() + lead_s) * 1000)))


def test_a_config_with_an_explicit_start_is_not_refused_while_it_waits_for_it():
    """Idle polls long after the fetch are no refusal while the start (less Kineto's 5 s warm-up) is
    ahead: the 8 s rule for Kineto's own start would have called this one dropped at the second poll."""
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(timed_config("w", 20), [41], 7, trace_id="51")
    poll(ep, IDLE)                     # fetched at ~start - 20 s
    for _ in range(3):                 # +15 s: activation is due by start - 5 s = +15 s
        clock.t += 5
        poll(ep, IDLE)
    assert said == []
    clock.t += 5                       # +20 s, the start: 5 s past the due activation, still < 6 s
    poll(ep, IDLE)
    assert said == []
    clock.t += 1.5                     # +21.5 s: idle past the start (+6 s after the activation was due)
    poll(ep, IDLE)
    assert [(o.kind, o.cause, o.trace_id) for o in said] == [("refused", "not_started", "51")]
    text = said[0].describe()
    assert "past the trace's start" in text and "insufficient time for warmup" in text and "free for the next" in text


def test_a_config_with_an_explicit_start_that_runs_is_never_refused():
    ep, clock, said = setup()
    poll(ep, IDLE)
    ep.trigger(timed_config("w", 20), [41], 7, trace_id="52")
    poll(ep, IDLE)
    clock.t += 15
    poll(ep, BUSY)                     # activated at start - 5 s: warm-up, then collection
    clock.t += 10
    poll(ep, IDLE)                     # written and idle again
    assert [(o.kind, o.trace_id) for o in said] == [("started", "52"), ("finished", "52")]
