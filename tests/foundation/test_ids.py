"""IDs are full-matched (\\A...\\Z / fullmatch; schema patterns with ECMA `$` = end of input): a
newline anywhere in an id, including the trailing one Python's `$` lets through, is refused by
every schema that names an id, by the agent's own id checks and by label-value checks."""

from __future__ import annotations

import pytest

from gpulens.capture import schemas
from gpulens.capture.agent.store import CAPTURE_ID_RE, TARGET_ID_RE
from gpulens.capture.wire import labels
from gpulens.exporter import kube

GOOD_CAPTURE = "c-20261201-abcdef"


def placements(good: str) -> list[str]:
    return [good + "\n", "\n" + good, good[:4] + "\n" + good[4:], good + "\r\n", good + "\n\n"]


def request(**over):
    return {"job_id": "train", "duration_ms": 200, "capture_id": GOOD_CAPTURE, **over}


@pytest.mark.parametrize("bad", placements(GOOD_CAPTURE))
def test_a_newline_in_a_capture_id_is_refused_everywhere(bad):
    assert schemas.errors("capture_request", request()) == []
    assert [e.field for e in schemas.errors("capture_request", request(capture_id=bad))] == ["capture_id"]
    assert CAPTURE_ID_RE.fullmatch(GOOD_CAPTURE) and not CAPTURE_ID_RE.fullmatch(bad)
    assert not CAPTURE_ID_RE.match(bad)  # also for callers that use match()


@pytest.mark.parametrize("bad", placements("train") + placements("rank-0"))
def test_a_newline_in_a_job_or_target_id_or_label_is_refused(bad):
    assert [e.field for e in schemas.errors("capture_request", request(job_id=bad))] == ["job_id"]
    assert not TARGET_ID_RE.match(bad) and not TARGET_ID_RE.fullmatch(bad)
    assert not labels.is_label_value(bad)
    assert not kube._LABEL_VALUE.match(bad)


def test_every_schema_pattern_is_anchored_at_the_end_of_input():
    """Walk every pattern in every schema: a match followed by a newline must not match."""
    samples = {"^[a-z0-9][a-z0-9-]{7,62}$": GOOD_CAPTURE, "^[A-Za-z0-9][A-Za-z0-9._-]*$": "train",
               "^[0-9a-f]{64}$": "0" * 64,
               "^[A-Za-z][A-Za-z0-9]*/[A-Za-z0-9][A-Za-z0-9._-]*$": "Deployment/web",
               "^(flight__ns[0-9]+__p[0-9]+[.]sock)?$": "flight__ns4026531836__p41.sock"}
    seen = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                seen.append(node["pattern"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    for name in schemas.SCHEMA_NAMES:
        walk(schemas.load(name))
    for p in {p for p in seen if p.endswith("$")}:
        assert p in samples, f"new schema pattern {p!r}: give this test a sample that matches it"
        good = samples[p]
        assert schemas._full(p).search(good) and not schemas._full(p).search(good + "\n"), p
