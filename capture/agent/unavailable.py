"""One shape for "this rank's evidence could not be had": a reason from a short fixed list (each
source names its own) and what was seen. A hang capture records both per rank and still converges."""

from __future__ import annotations

__all__ = ["Unavailable"]


class Unavailable(Exception):
    """No evidence of one kind from this rank; `reason` names why, `detail` says what was seen."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")
