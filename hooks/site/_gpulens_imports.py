"""Run a callback right after a named module has executed (a post-import hook, stdlib only).

The hook must act when torch (and its process-group module) is loaded, but must never import
torch itself: a launcher or a plain script that never touches torch pays nothing. `AfterImport`
sits first on `sys.meta_path`, lets the other finders find the module, and wraps only that spec's
loader; the module itself sees its real loader. It removes itself once every callback has run.
"""

from __future__ import annotations

import sys
from typing import Callable

Callback = Callable[[object], None]


class _Loader:
    def __init__(self, real, callback: Callback):
        self.real, self.callback = real, callback

    def create_module(self, spec):
        return self.real.create_module(spec) if hasattr(self.real, "create_module") else None

    def exec_module(self, module):
        module.__loader__ = self.real
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.real
        self.real.exec_module(module)
        self.callback(module)

    def __getattr__(self, name):  # anything else (get_resource_reader, is_package...) is the real loader's
        return getattr(self.real, name)


class AfterImport:
    def __init__(self, callbacks: dict[str, Callback]):
        self.callbacks = dict(callbacks)
        self._finding: set[str] = set()

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callback = self.callbacks.pop(name)
        if not self.callbacks:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        spec.loader = _Loader(spec.loader, callback)
        return spec
