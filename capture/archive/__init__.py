"""Where capture artifacts live once they leave the node: `file://` (embedded) or `s3://` (clusters).

`open_archive(prefix)` returns a store rooted at that prefix; every URI it writes or reads must stay
under that prefix (`ArchiveError` otherwise), so one job's coordinator can never read or
overwrite another job's captures through a crafted key, plain or percent-encoded (paths.py). `put_file_retrying` wraps any store's
`put_file` with bounded retries for stores that are briefly down.
"""

from .base import ArchiveError, ArchiveStore
from .opening import open_archive
from .paths import REPORT_KEY, SUMMARY_KEY, archive_path, join_uri, resolve, under_prefix
from .retrying import RetryPolicy, put_file_retrying

__all__ = ["REPORT_KEY", "SUMMARY_KEY", "ArchiveError", "ArchiveStore", "archive_path", "join_uri", "open_archive", "resolve", "under_prefix", "RetryPolicy", "put_file_retrying"]
