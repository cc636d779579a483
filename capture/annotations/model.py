"""An annotation as Grafana's legacy HTTP API knows it (`/api/annotations`), and the sink interface.

Times are epoch milliseconds (Grafana's unit); `text` is HTML that Grafana sanitizes and renders
(Markdown is not rendered); no dashboard uid makes an organisation annotation, which every
dashboard with a `gpulens` tag query shows (reference/ecosystem-conventions.md, section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Annotation", "AnnotationError", "AnnotationGone", "AnnotationSink"]


class AnnotationError(Exception):
    """The sink did not take the write. `ambiguous`: it may have been applied anyway (a timeout)."""

    def __init__(self, message: str, *, ambiguous: bool = False):
        super().__init__(message)
        self.ambiguous = ambiguous


class AnnotationGone(AnnotationError):
    """The annotation id no longer exists (someone deleted it): create it again."""


@dataclass(frozen=True)
class Annotation:
    time_ms: int
    text: str
    tags: tuple[str, ...]
    time_end_ms: int | None = None
    dashboard_uid: str | None = None
    panel_id: int | None = None

    def create_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"time": self.time_ms, "tags": list(self.tags), "text": self.text}
        if self.time_end_ms is not None:
            body["timeEnd"] = self.time_end_ms
        if self.dashboard_uid:
            body["dashboardUID"] = self.dashboard_uid
            if self.panel_id is not None:
                body["panelId"] = self.panel_id
        return body

    def patch_body(self) -> dict[str, Any]:
        """PATCH takes only text, tags, time and timeEnd."""
        body = {"time": self.time_ms, "tags": list(self.tags), "text": self.text}
        if self.time_end_ms is not None:
            body["timeEnd"] = self.time_end_ms
        return body


class AnnotationSink(Protocol):
    name: str

    async def create(self, annotation: Annotation) -> int: ...

    async def update(self, annotation_id: int, annotation: Annotation) -> None: ...

    async def find(self, tag: str) -> int | None:
        """The id of an existing annotation carrying `tag` (to resolve an ambiguous create)."""
