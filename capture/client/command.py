"""`gpulens capture start|status|watch|list|cancel`: a person's view of captures.

Talks to a coordinator or to the gateway (same API); `--url` or GPULENS_URL, token from
`--token-file` or GPULENS_TOKEN. `start --wait` and `watch` exit 0 when every rank was archived,
3 when the capture converged with failures, 4 when it could not run (refused, unreachable,
unknown, or failed before converging).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from .render import EXIT_COULD_NOT_RUN, EXIT_OK, format_event, format_list, format_status, verdict

DEFAULT_URL = "http://127.0.0.1:9453"


def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("GPULENS_URL", DEFAULT_URL),
                        help="gateway or coordinator URL (GPULENS_URL; default %(default)s)")
    common.add_argument("--token-file", type=Path, help="bearer token file (else GPULENS_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = sub.add_parser("start", parents=[common], help="start a capture of every rank of a job")
    start.add_argument("--job", help="job id (or --pod, through the gateway)")
    start.add_argument("--namespace", help="the job's namespace (needed through the gateway)")
    start.add_argument("--pod", help="route by one of the job's pods instead of --job (gateway)")
    start.add_argument("--attempt", type=int, help="refuse unless this is the job's current attempt")
    start.add_argument("--duration-ms", type=int, default=2000, help="window length (default %(default)s)")
    start.add_argument("--activities", help="comma list of Kineto activity types (default: CPU ops)")
    start.add_argument("--reason", help="free text recorded with the capture")
    start.add_argument("--wait", action="store_true", help="wait for convergence; exit 0 / 3 / 4")
    start.add_argument("--timeout-s", type=float, default=0, help="with --wait: give up after this long (0: never)")
    for name, text in (("status", "show one capture"), ("watch", "follow a capture live, per target"),
                       ("cancel", "cancel a capture (logical: queued traces still run)")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("capture_id", metavar="ID")
    lst = sub.add_parser("list", parents=[common], help="list captures")
    lst.add_argument("--namespace")
    lst.add_argument("--job")


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        return args.token_file.read_text().strip()
    return os.environ.get("GPULENS_TOKEN") or None


def _out(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=1, sort_keys=True, default=str) if args.json else text, flush=True)


def _err(text: str) -> None:
    print(f"gpulens capture: {text}", file=sys.stderr, flush=True)


async def _follow(api, capture_id: str, *, show, deadline: float | None) -> dict:
    """Follow the event stream to the end (re-connecting, or polling, if it breaks); the final status."""
    from .api import ApiError, ApiUnavailable
    failures = 0
    while True:
        if deadline and time.monotonic() > deadline:
            raise TimeoutError(capture_id)
        try:
            async for event in api.events(capture_id):
                failures = 0
                show(event)
                if event.get("event") == "end":
                    return await api.status(capture_id)
        except ApiUnavailable as exc:
            failures += 1
            if failures > 30:
                raise
            show({"event": "_retry", "error": str(exc)})
            await asyncio.sleep(min(5.0, 0.5 * failures))
        except ApiError:
            raise


async def _main(args: argparse.Namespace) -> int:
    import aiohttp

    from .api import ApiError, CaptureApi

    try:
        token = _token(args)
    except OSError as exc:
        _err(f"cannot read the token: {exc}")
        return EXIT_COULD_NOT_RUN
    async with aiohttp.ClientSession() as session:
        api = CaptureApi(session, args.url, token)
        try:
            if args.action == "start":
                return await _start(args, api)
            if args.action == "status":
                status = await api.status(args.capture_id)
                _out(args, status, format_status(status))
                return EXIT_OK
            if args.action == "list":
                data = await api.list(namespace=args.namespace, job_id=args.job)
                _out(args, data, format_list(data.get("captures", [])))
                return EXIT_OK
            if args.action == "cancel":
                status = await api.cancel(args.capture_id)
                _out(args, status, f"cancel requested for {args.capture_id} (phase {status.get('phase')}); "
                                   "traces already queued by dynolog still run")
                return EXIT_OK
            if args.action == "watch":
                return await _watch(args, api)
        except ApiError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            if body.get("phase") == "unknown":
                _err(f"{getattr(args, 'capture_id', '')}: unknown capture (its coordinator did not start it, "
                     "or restarted since)")
            else:
                _err(str(exc))
            return EXIT_COULD_NOT_RUN
    return EXIT_COULD_NOT_RUN


async def _start(args: argparse.Namespace, api) -> int:
    if not args.job and not (args.pod and args.namespace):
        _err("say which job: --job JOB, or --namespace NS --pod POD through the gateway")
        return EXIT_COULD_NOT_RUN
    request = {"duration_ms": args.duration_ms, "requested_by": os.environ.get("USER") or "cli"}
    if args.job:
        request["job_id"] = args.job
    if args.attempt is not None:
        request["attempt"] = args.attempt
    if args.activities:
        request["activities"] = [a.strip() for a in args.activities.split(",") if a.strip()]
    if args.reason:
        request["reason"] = {"kind": "manual", "text": args.reason}
    _, answer = await api.start(request, namespace=args.namespace, pod=args.pod)
    capture_id = answer["capture_id"]
    print(capture_id, flush=True)
    if not args.wait:
        return EXIT_OK
    deadline = time.monotonic() + args.timeout_s if args.timeout_s else None
    try:
        status = await _follow(api, capture_id, show=lambda e: None, deadline=deadline)
    except TimeoutError:
        _err(f"{capture_id}: still running after {args.timeout_s:.0f} s")
        return EXIT_COULD_NOT_RUN
    code, text = verdict(status)
    if status.get("manifest_uri"):
        print(status["manifest_uri"], flush=True)
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True, default=str))
    _err(f"{capture_id}: {text}")
    return code


async def _watch(args: argparse.Namespace, api) -> int:
    tty = sys.stdout.isatty() and not args.json
    latest: dict = {}

    def show(event: dict) -> None:
        if args.json:
            print(json.dumps(event, default=str), flush=True)
            return
        if event.get("event") == "_retry":
            _err(f"event stream interrupted, reconnecting: {event.get('error')}")
            return
        if event.get("event") in ("snapshot", "end") and isinstance(event.get("status"), dict):
            latest.update(event["status"])
        elif event.get("event") == "target" and latest.get("targets"):
            for t in latest["targets"]:
                if t["target_id"] == event.get("target_id"):
                    t.update(state=event.get("state"), reason=event.get("reason"), detail=event.get("detail"))
        elif event.get("event") == "phase":
            latest["phase"] = event.get("phase")
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + format_status(latest) + "\n")
            sys.stdout.flush()
        elif event.get("event") == "snapshot":
            print(format_status(event["status"]), flush=True)
        else:
            line = format_event(event)
            if line:
                print(line, flush=True)

    status = await _follow(api, args.capture_id, show=show, deadline=None)
    if not args.json:
        print(format_status(status) if tty else "", flush=True)
    code, text = verdict(status)
    _err(f"{args.capture_id}: {text}")
    return code


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))
