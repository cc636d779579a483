"""Where capture artifacts live once they leave the node: `file://` (embedded) or `s3://` (clusters).

`open_archive(prefix)` returns a store rooted at that prefix; every URI it writes or reads must stay
under that prefix (`ArchiveError` otherwise), so one job's coordinator can never read or
overwrite another job's captures through a crafted key. `put_file_retrying` wraps any store's
`put_file` with bounded retries for stores that are briefly down.
"""

from .base import ArchiveError, ArchiveStore, join_uri, open_archive, under_prefix
from .retrying import RetryPolicy, put_file_retrying

__all__ = ["ArchiveError", "ArchiveStore", "join_uri", "open_archive", "under_prefix", "RetryPolicy", "put_file_retrying"]
