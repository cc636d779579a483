"""What the page, the status reporter and the local operator need from `gpulens up`'s runner.

A Protocol here, so those modules depend on this interface and not on runner.py, which imports
them (that was an import circle).
"""

from __future__ import annotations

from typing import Any, Protocol

from .layout import Layout, Ports
from .supervisor import ChildSpec, Supervisor


class UpHost(Protocol):
    layout: Layout
    ports: Ports
    sup: Supervisor
    urls: dict[str, str]
    operator: Any  # the LocalOperator, once started (None before)

    def say(self, text: str) -> None: ...

    def coordinator_spec(self, namespace: str, job: str, attempt: int, index: int,
                         serving: bool = False) -> ChildSpec: ...
