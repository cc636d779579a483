"""`gpulens capture start|status|watch|list|cancel`: a person's view of captures.

Talks to a coordinator or to the gateway (same API); `--url` or GPULENS_URL, token from
`--token-file` or GPULENS_TOKEN. `start --wait` and `watch` exit 0 when every rank was archived,
3 when the capture converged with failures, 4 when it could not run (refused, unreachable,
unknown, or failed before converging); 2 is bad usage. Messages come from errors.py: the cause
in words and what to do next. `start` picks the capture id before it sends, so a retry after a
timeout or 503 can repeat it and get the same capture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from gpulens.ground.helptext import HelpFormatter

from .render import EXIT_COULD_NOT_RUN, EXIT_OK, format_event, format_list, format_status, verdict

DEFAULT_URL = "http://127.0.0.1:9453"


EXAMPLES = {
    "start": """examples:
  gpulens capture start --namespace demo --job demo --wait          # through the gateway; exit 0 / 3 / 4
  gpulens capture start --namespace ml --pod train-0 --duration-ms 5000 --activities cpu_op,kernel
  gpulens capture start --namespace ml --job train --capture-id c-20261201t101500-0a1b2c3d   # a safe retry
  gpulens capture start --namespace serve --workload Deployment/web --pod web-7f9c8d5b4-x2x9z --peers 1 --wait
                                                  # a replica and one healthy peer (serving; any gateway)""",
    "status": "example:\n  gpulens capture status c-20261201t101500-0a1b2c3d --json",
    "watch": "example:\n  gpulens capture watch c-20261201t101500-0a1b2c3d      # exit 0 / 3 / 4 like start --wait",
    "cancel": "example:\n  gpulens capture cancel c-20261201t101500-0a1b2c3d",
    "list": "examples:\n  gpulens capture list\n  gpulens capture list --namespace ml --job train",
}

EPILOG = """examples:
  export GPULENS_URL=http://127.0.0.1:9453 GPULENS_TOKEN=$(cat .gpulens/secrets/gateway.token)
  gpulens capture start --namespace demo --job demo --wait
  gpulens capture list

exit codes: 0 every rank archived (or the action worked), 2 bad usage (fix the command),
3 converged with some ranks failed, 4 could not run (refused, unreachable, unknown capture)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog, parser.formatter_class = EPILOG, HelpFormatter
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("GPULENS_URL", DEFAULT_URL),
                        help="the gateway's (or one coordinator's) URL; env GPULENS_URL")
    common.add_argument("--token-file", type=Path, default=None,
                        help="file holding the token this command presents (the gateway's, or the coordinator's "
                             "when --url is one); else env GPULENS_TOKEN")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="log level of this command")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=text, description=text, epilog=EXAMPLES[name],
                              formatter_class=HelpFormatter)

    start = add("start", "start a capture of every rank of a job")
    start.add_argument("--job", help="the job id (GPULENS_JOB_ID of its trainer); or route by --pod")
    start.add_argument("--namespace", help="the job's namespace (needed through the gateway)")
    start.add_argument("--pod", help="route by one of the job's pods instead of --job (gateway only)")
    start.add_argument("--workload", metavar="KIND/NAME",
                       help="a serving workload (Deployment/NAME, StatefulSet/NAME, LeaderWorkerSet/NAME): with --pod, "
                            "capture that replica; a Deployment's revision is told from the pod's name, so no --job is "
                            "needed, also through a cluster's gateway (which knows no pods)")
    start.add_argument("--peers", type=int, metavar="N",
                       help="with --pod on a serving workload: also N healthy replicas of its revision, to compare")
    start.add_argument("--replicas", type=int, metavar="N",
                       help="a serving workload without --pod: N of its replicas")
    start.add_argument("--attempt", type=int, help="refuse unless this is the job's current attempt (restart count)")
    start.add_argument("--duration-ms", type=int, default=None,
                       help="window length in milliseconds (100..600000; default 2000), or with --iterations the most "
                            "they may take (default 30000)")
    start.add_argument("--iterations", type=int, metavar="N",
                       help="trace N training iterations (optimizer steps), every rank from the same iteration")
    start.add_argument("--iteration-roundup", type=int, metavar="R",
                       help="with --iterations: start at a multiple of R (default: the coordinator's choice)")
    start.add_argument("--budget-mb", type=int, metavar="MIB",
                       help="uncompressed trace MiB each rank may write (default: the coordinator's, 200); iterations, "
                            "window and payload options are fitted to it, or the capture is refused with the estimate")
    start.add_argument("--hang", action="store_true",
                       help="a hang capture: every rank's Flight Recorder dump (its last collectives) and every "
                            "thread's Python stack, for a job that stalled; the report names the rank that holds "
                            "the others up (no Kineto window: --duration-ms and --iterations do not apply)")
    start.add_argument("--baseline", action="store_true",
                       help="a healthy reference capture: later reports of the job compare with it")
    start.add_argument("--activities", help="comma list of Kineto activity types (default: cpu_op,user_annotation,"
                                            "cpu_instant_event)")
    start.add_argument("--with-stack", action="store_true", help="record Python stacks with each op (bigger traces)")
    start.add_argument("--record-shapes", action="store_true", help="record input shapes with each op")
    start.add_argument("--reason", help="free text recorded with the capture")
    start.add_argument("--capture-id", metavar="ID",
                       help="use this capture id (default: a new one, picked before sending); repeating a request "
                            "with the same id returns the same capture, so retries are safe")
    start.add_argument("--wait", action="store_true", help="wait for convergence; exit 0 / 3 / 4")
    start.add_argument("--timeout-s", "--wait-timeout-s", dest="timeout_s", type=float, default=0,
                       help="with --wait: give up waiting after this many seconds (0: never)")
    for name, text in (("status", "show one capture"), ("watch", "follow a capture live, per target"),
                       ("cancel", "cancel a capture (logical: traces already queued by dynolog still run)")):
        p = add(name, text)
        p.add_argument("capture_id", metavar="ID", help="the capture id that start printed (c-<time>-<hex>)")
    lst = add("list", "list captures (newest first)")
    lst.add_argument("--namespace", help="only this namespace's job (with --job)")
    lst.add_argument("--job", help="only this job's captures (with --namespace)")


def _token(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(token, where it came from)."""
    if args.token_file:
        return args.token_file.read_text().strip(), f"--token-file {args.token_file}"
    token = os.environ.get("GPULENS_TOKEN") or None
    return token, ("GPULENS_TOKEN" if token else None)


def _out(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=1, sort_keys=True, default=str) if args.json else text, flush=True)


def _err(text: str) -> None:
    print(f"gpulens capture: {text}", file=sys.stderr, flush=True)


def _fail(problem) -> int:
    _err(problem.text())
    return problem.code


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
    from .errors import EXIT_USAGE, Context, Problem, check_url, explain

    bad_url = check_url(args.url)
    if bad_url:
        return _fail(bad_url)
    try:
        token, source = _token(args)
    except OSError as exc:
        return _fail(Problem(EXIT_USAGE, f"--token-file {args.token_file} cannot be read ({exc.strerror or exc})",
                             "pass the path of a readable token file, or set GPULENS_TOKEN"))
    ctx = Context(args.action, args.url, source, getattr(args, "capture_id", None))
    async with aiohttp.ClientSession() as session:
        api = CaptureApi(session, args.url, token)
        try:
            if args.action == "start":
                return await _start(args, api, ctx)
            if args.action == "status":
                status = await api.status(args.capture_id)
                _out(args, status, format_status(status))
                return EXIT_OK
            if args.action == "list":
                if bool(args.namespace) != bool(args.job):
                    return _fail(Problem(EXIT_USAGE, "list filters by one job: --namespace and --job go together",
                                         "pass both (gpulens capture list --namespace NS --job JOB), or neither"))
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
            return _fail(explain(exc, ctx))
    return EXIT_COULD_NOT_RUN


async def _start(args: argparse.Namespace, api, ctx) -> int:
    from dataclasses import replace

    from gpulens.capture.activities import DEFAULT_CPU_ACTIVITIES
    from gpulens.capture.models import CaptureOptions, CaptureReason, CaptureRequest, new_capture_id

    from .api import ApiError
    from .errors import EXIT_USAGE, Problem, explain

    if args.workload and not (args.pod or args.job):
        return _fail(Problem(EXIT_USAGE, "--workload needs --pod (or the revision's --job)",
                             f"pass --workload {args.workload} --pod POD"))
    if not args.job and not args.pod:
        return _fail(Problem(EXIT_USAGE, "say which job to capture",
                             "pass --namespace NS --job JOB (or --namespace NS --pod POD through the gateway)"))
    if args.pod and not args.namespace:
        return _fail(Problem(EXIT_USAGE, "--pod needs --namespace", "pass --namespace NS --pod POD"))
    if args.peers is not None and not args.pod:
        return _fail(Problem(EXIT_USAGE, "--peers needs --pod (the replica they are compared with)",
                             "pass --pod POD --peers N, or --replicas N for any N replicas"))
    if args.replicas is not None and args.pod:
        return _fail(Problem(EXIT_USAGE, "--replicas takes any replicas; with --pod use --peers",
                             "pass --pod POD --peers N, or --replicas N without --pod"))
    serving = bool(args.workload or args.peers is not None or args.replicas is not None)
    if args.hang and (args.iterations or args.baseline or serving):
        return _fail(Problem(EXIT_USAGE, "--hang reads each rank as it is now: it takes no --iterations, --baseline, "
                                         "--workload, --peers or --replicas", "pass --hang with --job (or --pod) only"))
    capture_id = args.capture_id or new_capture_id()   # picked before sending: a retry can repeat it
    ctx = replace(ctx, capture_id=capture_id)
    duration_ms = args.duration_ms or (30_000 if args.iterations else 2000)
    options = CaptureOptions(**{k: True for k in ("with_stack", "record_shapes") if getattr(args, k)})
    activities = tuple(a.strip() for a in (args.activities or "").split(",") if a.strip())
    # the models' own request type writes the wire form (schemas/capture_request.schema.json); with --pod
    # and no --job the gateway resolves the job, so job_id is left out rather than sent empty
    request = CaptureRequest(
        job_id=args.job or "", duration_ms=duration_ms, attempt=args.attempt, options=options,
        reason=CaptureReason(kind="manual", text=args.reason) if args.reason else CaptureReason(),
        requested_by=os.environ.get("USER") or "cli", capture_id=capture_id, iterations=args.iterations,
        iteration_roundup=args.iteration_roundup, baseline=bool(args.baseline), budget_mb=args.budget_mb,
        activities=activities or DEFAULT_CPU_ACTIVITIES,
        # a serving capture names its replica in the request (the coordinator targets it) rather than
        # routing by it: the gateway finds the revision from --workload and the pod's name
        pods=(args.pod,) if serving and args.pod else (), peers=args.peers, replicas=args.replicas,
        kind="hang" if args.hang else "trace").to_dict()
    if not args.job:
        del request["job_id"]
    try:
        _, answer = await api.start(request, namespace=args.namespace, pod=None if serving else args.pod,
                                    workload=args.workload)
    except ApiError as exc:
        return _fail(explain(exc, ctx))
    capture_id = answer.get("capture_id", capture_id) if isinstance(answer, dict) else capture_id
    print(capture_id, flush=True)
    if isinstance(answer, dict) and answer.get("created") is False:
        _err(f"{capture_id}: this capture was already started by an earlier request with the same id")
    if not args.wait:
        return EXIT_OK
    deadline = time.monotonic() + args.timeout_s if args.timeout_s else None
    try:
        status = await _follow(api, capture_id, show=lambda e: None, deadline=deadline)
    except TimeoutError:
        return _fail(Problem(EXIT_COULD_NOT_RUN, f"{capture_id}: still running after {args.timeout_s:.0f} s",
                             f"gpulens capture watch {capture_id}"))
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
