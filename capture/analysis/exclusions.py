"""Why a rank that the manifest names was left out of the analysis (reported, never silent)."""

from __future__ import annotations

from enum import Enum

__all__ = ["Exclusion"]


class Exclusion(str, Enum):
    FETCH_FAILED = "fetch_failed"            # the archive would not give the bytes (or the URI is outside the capture)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the bytes are not the ones the manifest recorded
    UNREADABLE = "unreadable"                # not a Kineto JSON trace (bad gzip, bad JSON, no complete events)
    RANK_MISMATCH = "rank_mismatch"          # the file's distributedInfo.rank contradicts the manifest
    DUPLICATE_RANK = "duplicate_rank"        # an earlier artifact of the manifest already holds this rank
    CLOCK_MISMATCH = "clock_mismatch"        # not on the clock base of the other ranks: not the same job/window
    OUTSIDE_WINDOW = "outside_window"        # the trace's time span is not inside the capture's window
    WORLD_SIZE_MISMATCH = "world_size_mismatch"  # distributedInfo.world_size differs from the other ranks'
    HTA_PARSE_FAILED = "hta_parse_failed"    # passed our checks, but HTA's parser raised
    UNANALYSABLE = "unanalysable"            # the worker analysing it died on every try (memory limit, pod deleted)
