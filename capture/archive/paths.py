"""The one path rule for archive URIs and keys: decode first, check after, use what was checked.

Why: a prefix test on the still-encoded text let `file://<root>/%2e%2e/%2e%2e/x` pass and then
write outside the root once decoded. Here each `/`-separated segment is percent-decoded until it
no longer changes (so doubly encoded `%252e%252e` is caught too), and a URI is refused when any
segment decodes to `.` or `..`, contains `/` (an encoded `%2f`), `\\` or NUL, or is empty in the
middle; or when its netloc decodes to something else; or when it carries a query or fragment.
`under_prefix` compares decoded segments, and the stores read and write the decoded path that was
compared, never a re-parse of the raw text. Used by agent dispatch, both stores, the coordinator's
artifact check and the analysis' fetches (through the stores).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .base import ArchiveError

__all__ = ["ArchivePath", "archive_path", "under_prefix", "resolve", "join_uri", "host_dir", "SCHEMES",
           "SUMMARY_KEY", "REPORT_KEY"]

SCHEMES = ("file", "s3")
#: where `gpulens analyze` writes a capture's outputs, under the folder of its manifest: the
#: coordinator reads the summary's verdict from there and links the report, wherever analysis ran
SUMMARY_KEY = "analysis/summary.json"
REPORT_KEY = "analysis/report.html"
_MAX_DECODES = 4  # a segment still changing after this many decodings is refused outright


@dataclass(frozen=True)
class ArchivePath:
    """A decoded archive URI: `segments` are the path's parts, never `.`/`..`/empty."""

    scheme: str
    netloc: str
    segments: tuple[str, ...]

    @property
    def path(self) -> str:
        """The decoded absolute path (file://) or, without the leading `/`, the S3 key."""
        return "/" + "/".join(self.segments)

    def within(self, prefix: "ArchivePath") -> bool:
        return ((self.scheme, self.netloc) == (prefix.scheme, prefix.netloc)
                and self.segments[:len(prefix.segments)] == prefix.segments)


def _decoded(part: str, what: str, uri: str) -> str:
    seen = part
    for _ in range(_MAX_DECODES):
        nxt = unquote(seen, errors="strict")
        if nxt == seen:
            return seen
        seen = nxt
    raise ArchiveError(f"{what} of {uri!r} is encoded more than {_MAX_DECODES} times")


def _segment(raw: str, uri: str) -> str:
    try:
        seg = _decoded(raw, "a path segment", uri)
    except UnicodeDecodeError as exc:
        raise ArchiveError(f"archive URI {uri!r} has a segment that is not UTF-8 once decoded") from exc
    if seg in (".", "..") or "/" in seg or "\\" in seg or "\x00" in seg:
        raise ArchiveError(f"archive URI {uri!r} has a segment {raw!r} that decodes to {seg!r}: "
                           "no '.', '..', '/', '\\' or NUL may appear once decoded")
    return seg


def archive_path(uri: str) -> ArchivePath:
    """Parse and decode `uri` (`file:///...` or `s3://bucket/...`); ArchiveError if unsafe."""
    if not isinstance(uri, str) or "\x00" in uri or any(c in uri for c in "\r\n\t"):
        raise ArchiveError(f"archive URI {uri!r} contains a control character")
    u = urlsplit(uri)
    if u.scheme not in SCHEMES:
        raise ArchiveError(f"unsupported archive URI {uri!r}: use file:///path or s3://bucket/prefix")
    if u.query or u.fragment or "?" in uri or "#" in uri:
        raise ArchiveError(f"archive URI {uri!r} may not carry a query or fragment")
    try:
        netloc = _decoded(u.netloc, "the host", uri)
    except UnicodeDecodeError as exc:
        raise ArchiveError(f"archive URI {uri!r} has a host that is not UTF-8") from exc
    if netloc != u.netloc or any(c in netloc for c in "@:/\\"):
        raise ArchiveError(f"archive URI {uri!r} has an encoded or credentialed host {u.netloc!r}")
    if u.scheme == "file" and netloc not in ("", "localhost"):
        raise ArchiveError(f"file:// archive URI {uri!r} names a host; use file:///path")
    if u.scheme == "s3" and not netloc:
        raise ArchiveError(f"s3:// archive URI {uri!r} names no bucket")
    raw = u.path[1:] if u.path.startswith("/") else u.path
    parts = raw.split("/") if raw else []
    if parts and parts[-1] == "":
        parts.pop()  # one trailing slash names the folder itself
    if any(p == "" for p in parts):
        raise ArchiveError(f"archive URI {uri!r} has an empty path segment ('//')")
    return ArchivePath(u.scheme, "" if u.scheme == "file" else netloc, tuple(_segment(p, uri) for p in parts))


def under_prefix(prefix: str, uri: str) -> bool:
    """True when `uri`, decoded and safe, names `prefix` or something below it."""
    try:
        return archive_path(uri).within(archive_path(prefix))
    except ArchiveError:
        return False


def resolve(prefix: str, uri: str) -> ArchivePath:
    """The decoded path of `uri`, refused (ArchiveError) unless it is safe and under `prefix`."""
    base, target = archive_path(prefix), archive_path(uri)
    if not target.within(base):
        raise ArchiveError(f"{uri} is outside the archive prefix {prefix}")
    return target


def join_uri(prefix: str, key: str) -> str:
    """`<prefix>/<key>`, refusing keys that decode to anything but plain segments under prefix."""
    uri = prefix.rstrip("/") + "/" + key.lstrip("/")
    if not key.strip("/") or not resolve(prefix, uri).segments[len(archive_path(prefix).segments):]:
        raise ArchiveError(f"bad archive key {key!r}")
    return uri


def host_dir(root: str) -> str | None:
    """The local folder of a `file://` archive root, None for s3:// (or a root that is refused).

    In Kubernetes that folder is a hostPath every writer and reader of the archive mounts at the
    same path (single node only), so URIs mean the same file in every pod.
    """
    if not isinstance(root, str) or not root.startswith("file://"):
        return None
    try:
        return archive_path(root).path
    except ArchiveError:
        return None
