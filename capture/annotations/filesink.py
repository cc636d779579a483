"""The embedded stand-in for Grafana: annotations in a JSON file, plus an HTML page beside it.

Several coordinators (one per job attempt) share one file under `gpulens up`, so every write
takes an exclusive lock on `<file>.lock` and replaces the file atomically; readers (the local
page) never see a half-written file. Entries have Grafana's shape (`id`, `time`, `timeEnd` in
ms, `tags`, `text` as HTML).
"""

from __future__ import annotations

import asyncio
import fcntl
import html
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .model import Annotation, AnnotationError, AnnotationGone

__all__ = ["FileSink", "render_page"]


def render_page(annotations: list[dict[str, Any]]) -> str:
    rows = []
    for a in sorted(annotations, key=lambda a: a.get("time", 0), reverse=True):
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.get("time", 0) / 1000))
        end = time.strftime("%H:%M:%S", time.localtime(a["timeEnd"] / 1000)) if a.get("timeEnd") else "…"
        tags = " ".join(f"<code>{html.escape(str(t))}</code>" for t in a.get("tags", []))
        # text is HTML the coordinator built with every label escaped (annotations.render)
        rows.append(f"<tr><td>{html.escape(start)} – {html.escape(end)}</td><td>{tags}</td><td>{a.get('text', '')}</td></tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>gpulens annotations</title>"
            "<meta http-equiv='refresh' content='10'><style>body{font-family:sans-serif;margin:2em}"
            "td{padding:.3em .8em;vertical-align:top}</style></head><body><h1>gpulens capture annotations</h1>"
            f"<table>{''.join(rows) or '<tr><td>none yet</td></tr>'}</table></body></html>")


class FileSink:
    def __init__(self, path: Path, *, page: Path | None = None):
        self.name = "file"
        self.path = Path(path)
        self.page = Path(page) if page else self.path.with_suffix(".html")

    @contextmanager
    def _locked(self, write: bool = True) -> Iterator[list[dict[str, Any]]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    doc = json.loads(self.path.read_text())
                    items = doc.get("annotations", []) if isinstance(doc, dict) else []
                except FileNotFoundError:
                    items = []
                except ValueError as exc:
                    raise AnnotationError(f"{self.path} is not JSON; not overwriting it: {exc}") from exc
                yield items
                if write:
                    self._replace(self.path, json.dumps({"annotations": items}, indent=1, sort_keys=True))
                    self._replace(self.page, render_page(items))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _replace(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    async def _run(self, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except OSError as exc:
            raise AnnotationError(f"{self.path}: {exc}") from exc

    async def create(self, annotation: Annotation) -> int:
        def do() -> int:
            with self._locked() as items:
                new_id = max((a.get("id", 0) for a in items), default=0) + 1
                now = int(time.time() * 1000)
                items.append({"id": new_id, **annotation.create_body(), "created": now, "updated": now})
                return new_id
        return await self._run(do)

    async def update(self, annotation_id: int, annotation: Annotation) -> None:
        def do() -> None:
            with self._locked() as items:
                for a in items:
                    if a.get("id") == annotation_id:
                        a.update(annotation.patch_body(), updated=int(time.time() * 1000))
                        return
                raise AnnotationGone(f"annotation {annotation_id} is not in {self.path}")
        await self._run(do)

    async def find(self, tag: str) -> int | None:
        def do() -> int | None:
            with self._locked(write=False) as items:
                return min((a["id"] for a in items if tag in a.get("tags", [])), default=None)
        return await self._run(do)
