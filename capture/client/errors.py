"""One error style for `gpulens capture`: the cause in words, then what to do next.

Every refusal, transport failure and bad option becomes a `Problem` (exit code, cause, next step)
here, so the command never prints an HTTP status line or an exception class name. Exit codes:
2 = bad usage (a flag or its value is wrong: fix the command), 4 = could not run (refused,
unreachable, unknown), 3 is the capture's own verdict (render.verdict).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpulens.capture.activities import CORE_ACTIVITY_TYPES

from .api import ApiError, ApiUnavailable
from .render import EXIT_COULD_NOT_RUN

__all__ = ["EXIT_USAGE", "Problem", "Context", "explain", "check_url", "outcome_unknown"]

EXIT_USAGE = 2

#: request field (as the servers name it in a 400's `field`) -> the flag a person sets
FLAGS = {"namespace": "--namespace", "job_id": "--job", "pod": "--pod", "attempt": "--attempt",
         "duration_ms": "--duration-ms", "activities": "--activities", "capture_id": "--capture-id",
         "reason": "--reason", "workload": "--workload", "pods": "--pod", "peers": "--peers", "replicas": "--replicas"}


@dataclass(frozen=True)
class Problem:
    code: int
    cause: str
    next_step: str | None = None

    def text(self) -> str:
        return self.cause + (f"\n  next: {self.next_step}" if self.next_step else "")


@dataclass(frozen=True)
class Context:
    """What the command was doing, so the message can name the right flag, id and token source."""

    action: str
    url: str
    token_source: str | None = None          # "--token-file PATH", "GPULENS_TOKEN" or None
    capture_id: str | None = None


def check_url(url: str) -> Problem | None:
    """A URL the client can use, or why not (before anything is sent)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return Problem(EXIT_USAGE, f"--url {url!r} is not an http:// or https:// URL",
                       "pass the gateway's address with its scheme, e.g. --url http://127.0.0.1:9453 "
                       "(or set GPULENS_URL)")
    try:
        parts.port
    except ValueError:
        return Problem(EXIT_USAGE, f"--url {url!r} has an invalid port",
                       "use HOST:PORT with a port between 1 and 65535, e.g. --url http://127.0.0.1:9453")
    return None


def outcome_unknown(capture_id: str, cause: str) -> Problem:
    return Problem(EXIT_COULD_NOT_RUN, f"{cause}; outcome unknown — the capture may still start",
                   f"gpulens capture status {capture_id}  (a retry with --capture-id {capture_id} "
                   "returns that capture instead of starting a second one)")


def _field_root(field: Any) -> str:
    return str(field or "").split("[", 1)[0].split(".", 1)[0]


def _transport(exc: ApiUnavailable, ctx: Context) -> str:
    cause, host = exc.cause, urlsplit(ctx.url).netloc or ctx.url
    import aiohttp
    if isinstance(cause, (aiohttp.InvalidURL, getattr(aiohttp, "NonHttpUrlClientError", ()))):
        return f"{ctx.url!r} is not a URL the client can open"
    if isinstance(cause, getattr(aiohttp, "ClientConnectorDNSError", ())):
        return f"the host name in {ctx.url} does not resolve"
    if isinstance(cause, aiohttp.ClientConnectorError):
        return f"nothing answers at {host} (connection refused)"
    if isinstance(cause, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return f"no answer from {host} in time"
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return f"{host} closed the connection without answering"
    if exc.status >= 500:
        body = exc.body if isinstance(exc.body, dict) else {}
        return f"the server at {host} could not serve this ({body.get('error') or 'HTTP ' + str(exc.status)})"
    if cause is not None:
        return f"the connection to {host} failed ({str(cause) or 'no detail'})"
    return str(exc.body or "the connection failed")


def explain(exc: ApiError, ctx: Context) -> Problem:
    """A person's message for one failed request."""
    body = exc.body if isinstance(exc.body, dict) else {}
    error = str(body.get("error") or (exc.body if isinstance(exc.body, str) else "") or "").strip()
    known = body.get("known_jobs")
    known_text = f"known jobs: {', '.join(known)}" if known else "no job is known yet (has an armed trainer registered?)"
    if isinstance(exc, ApiUnavailable):
        cause = _transport(exc, ctx)
        if ctx.action == "start" and ctx.capture_id:
            return outcome_unknown(ctx.capture_id, cause)
        if exc.status == 0 and "refused" in cause:
            return Problem(EXIT_COULD_NOT_RUN, cause, "is the gateway running (gpulens up, or gpulens gateway)? "
                           "Point --url or GPULENS_URL at it")
        return Problem(EXIT_COULD_NOT_RUN, cause, "try again in a moment; the server's log says more")
    if exc.status == 401:
        if ctx.token_source is None:
            return Problem(EXIT_COULD_NOT_RUN, "the server wants a token and none was given",
                           "set GPULENS_TOKEN or pass --token-file FILE (gpulens up prints the file: "
                           "<workdir>/secrets/gateway.token)")
        return Problem(EXIT_COULD_NOT_RUN, f"the server refused the token from {ctx.token_source}",
                       "use the token of the server at --url (the gateway's, or the coordinator's when --url "
                       "is a coordinator)")
    if exc.status == 403:
        return Problem(EXIT_COULD_NOT_RUN, f"the token from {ctx.token_source or 'nowhere'} may not do this "
                       f"({error or 'forbidden'})", "ask for a token with this permission")
    if body.get("phase") == "unknown" or (exc.status == 404 and ctx.action in ("status", "watch", "cancel")):
        return Problem(EXIT_COULD_NOT_RUN, f"{ctx.capture_id}: unknown capture (no coordinator behind "
                       f"{urlsplit(ctx.url).netloc} started it)",
                       "check the id against gpulens capture list (a capture started through another "
                       "gateway or coordinator is known only there)")
    field = _field_root(body.get("field"))
    flag = FLAGS.get(field)
    if exc.status == 404 and field == "pod":
        return Problem(EXIT_USAGE, error or "no such pod", f"pass --namespace NS --job JOB of a known job, or for a "
                       f"replica of a serving workload --workload Deployment/NAME with --pod; {known_text}")
    if exc.status == 404 and field in ("job_id", "namespace"):
        return Problem(EXIT_USAGE, error or "no such job", f"pass --namespace NS --job JOB of a known job; {known_text}")
    if exc.status == 400 and flag:
        hint = f"fix {flag}"
        if field == "activities":
            hint += "; valid values: " + ",".join(CORE_ACTIVITY_TYPES)
        elif field == "namespace":
            hint = f"pass --namespace NS (the job's namespace: the gateway routes by it); {known_text}"
        elif field == "job_id":
            hint = "pass the --job this coordinator serves (its /healthz says which), or --url of the job's gateway"
        return Problem(EXIT_USAGE, f"{flag}: {error or 'invalid value'}", hint)
    if exc.status == 400:
        return Problem(EXIT_USAGE, error or "the request was refused as malformed", "see gpulens capture --help")
    if exc.status == 409 and error == "capture_in_progress":
        other = body.get("capture_id")
        return Problem(EXIT_COULD_NOT_RUN, f"another capture of this job is still running ({other})",
                       f"wait for it (gpulens capture watch {other}) and start again")
    if exc.status == 409:
        return Problem(EXIT_COULD_NOT_RUN, error or "refused: the request conflicts with the job's state",
                       f"check {flag}" if flag else "see gpulens capture status / list")
    return Problem(EXIT_COULD_NOT_RUN, error or f"refused by the server (HTTP {exc.status})",
                   "the server's log says more")
