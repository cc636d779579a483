"""Remove the registration record on SIGTERM and SIGINT without changing the trainer's own handling.

Kubernetes stops a pod with SIGTERM, and a process killed by a signal's default action runs no
`atexit` handler, so the record would outlive the worker. `ExitSignals` installs one handler for
both signals that runs the cleanup and then does exactly what would have happened without it:
- the trainer's handler (installed before or after us: `signal.signal` is wrapped so that a later
  handler is chained instead of replacing ours, and `signal.getsignal` reports the trainer's) is
  called with the same arguments;
- SIG_DFL (or a handler not installed from Python) is re-raised with the default disposition, so
  the exit status is still "killed by SIGTERM";
- SIG_IGN stays ignored, and the record stays, since the process lives on.
A forked child inherits the handler; the cleanup only acts in the process that registered.
`signal` and `threading` are imported on install only (a registering process has torch, which
imports both anyway), so interpreter start-up does not pay for them.
"""

from __future__ import annotations

import os
from typing import Callable


class ExitSignals:
    def __init__(self, cleanup: Callable[[], None]):
        self.cleanup = cleanup
        self.theirs: dict[int, object] = {}
        self.installed = False

    def install(self) -> bool:
        """Install (main thread only, as Python requires); False where that is not possible."""
        import signal
        import threading

        self._signal_mod, self._threading = signal, threading
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self._real_signal, self._real_getsignal = signal.signal, signal.getsignal
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.theirs[int(sig)] = self._real_getsignal(sig)
            self._real_signal(sig, self._handle)
        signal.signal, signal.getsignal = self._signal, self._getsignal
        self.installed = True
        return True

    # what the trainer sees -------------------------------------------------------------------

    def _signal(self, signalnum, handler):
        num = int(signalnum)
        if num not in self.theirs or self._threading.current_thread() is not self._threading.main_thread():
            return self._real_signal(signalnum, handler)  # other signals, and the real ValueError off-main
        if not (callable(handler) or handler in (self._signal_mod.SIG_DFL, self._signal_mod.SIG_IGN)):
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        previous, self.theirs[num] = self.theirs[num], handler
        return previous

    def _getsignal(self, signalnum):
        num = int(signalnum)
        return self.theirs[num] if num in self.theirs else self._real_getsignal(signalnum)

    # what happens on the signal --------------------------------------------------------------

    def _handle(self, signum, frame):
        theirs = self.theirs.get(int(signum))
        if theirs == self._signal_mod.SIG_IGN:
            return None
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001 - never let our cleanup change the trainer's shutdown
            pass
        if callable(theirs):
            return theirs(signum, frame)
        self._real_signal(signum, self._signal_mod.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None
