"""Running a server command until SIGTERM or SIGINT, shared by the components' `run()`."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Awaitable, Callable

__all__ = ["serve_until_stopped"]


def serve_until_stopped(serve: Callable[[asyncio.Event], Awaitable[int]], *, prog: str,
                        errors: tuple[type[BaseException], ...] = (ValueError,)) -> int:
    """Run `serve(stop)` on a fresh event loop; `stop` is set by SIGTERM or SIGINT.

    A start-up error of one of `errors` (a missing secret file, a bad template) is one line on
    stderr and exit code 2, never a traceback.
    """
    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await serve(stop)

    try:
        return asyncio.run(main())
    except errors as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
