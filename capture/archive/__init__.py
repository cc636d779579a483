"""Where capture artifacts live once they leave the node: `file://` (embedded) or `s3://` (clusters).

`open_archive(prefix)` returns a store rooted at that prefix; every URI it writes or reads must stay
under that prefix (`ArchiveError` otherwise), so one job's coordinator can never read or
overwrite another job's captures through a crafted key.
"""

from .base import ArchiveError, ArchiveStore, join_uri, open_archive, under_prefix

__all__ = ["ArchiveError", "ArchiveStore", "join_uri", "open_archive", "under_prefix"]
