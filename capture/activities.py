"""Kineto activity type names that a capture request may ask for.

Kineto drops a whole on-demand config when one `ACTIVITY_TYPES` entry is unknown to it (the parse
stops at the throwing line and the request is silently cancelled), so requests are restricted to
the twelve names every Kineto since 2023 knows, unless the trainer's Kineto version is known.
Source: shared/reference/dynolog-kineto-protocol.md section 4.3.
"""

from __future__ import annotations

__all__ = ["CORE_ACTIVITY_TYPES", "NEWER_ACTIVITY_TYPES", "DEFAULT_CPU_ACTIVITIES", "unknown_activities"]

#: Valid in every Kineto since at least 2023-05.
CORE_ACTIVITY_TYPES: tuple[str, ...] = (
    "cpu_op",
    "user_annotation",
    "gpu_user_annotation",
    "gpu_memcpy",
    "gpu_memset",
    "kernel",
    "external_correlation",
    "cuda_runtime",
    "cuda_driver",
    "cpu_instant_event",
    "python_function",
    "overhead",
)

#: Known to newer Kineto builds only; accepted only when the caller says the version allows them.
NEWER_ACTIVITY_TYPES: tuple[str, ...] = (
    "cuda_sync",
    "cuda_event",
    "mtia_runtime",
    "mtia_ccp_events",
    "mtia_insight",
    "mtia_counters",
)

#: What a CPU-only trainer produces without asking for stacks.
DEFAULT_CPU_ACTIVITIES: tuple[str, ...] = ("cpu_op", "user_annotation", "cpu_instant_event")


def unknown_activities(names: list[str] | tuple[str, ...], *, allow_newer: bool = False) -> list[str]:
    """Return the names Kineto might not know (empty when all are safe to send)."""
    allowed = set(CORE_ACTIVITY_TYPES) | (set(NEWER_ACTIVITY_TYPES) if allow_newer else set())
    return [n for n in names if n not in allowed]
