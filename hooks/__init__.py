"""The trainer-side hook. Its code lives in `hooks/site/` and needs only the standard library,
because it runs inside arbitrary trainer images; this package just locates and exposes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["hook_path", "load_hook_module"]


def hook_path() -> Path:
    """The folder to put on a trainer's PYTHONPATH."""
    return Path(__file__).resolve().parent / "site"


def load_hook_module() -> ModuleType:
    """The arming module (`_gpulens_hook`), for tests and for the agent's file-name rules."""
    import sys

    spec = importlib.util.spec_from_file_location("_gpulens_hook", hook_path() / "_gpulens_hook.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(hook_path()))  # its sibling modules, as sitecustomize finds them
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(hook_path()))
    return module
