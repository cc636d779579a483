"""JSON Schemas for every wire format gpulens speaks, and one way to check them.

The schemas are the contract between processes (hook -> agent, person/gateway -> coordinator,
coordinator -> agent, coordinator -> analysis); the dataclasses in `gpulens.capture.models` are the typed
view of the same data. Errors name the offending field, so a 400 tells the caller what to fix.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry, Resource

__all__ = ["SCHEMA_NAMES", "SchemaError", "load", "validate", "errors"]

SCHEMA_NAMES = ("registration", "capture_request", "dispatch", "target_status", "manifest", "summary", "rank_summary",
                "flight_recorder", "python_stacks", "hang_evidence", "hang_summary")
_BASE = "https://gpulens.dev/schemas/"


class SchemaError(ValueError):
    """Input that does not match its schema; `.field` is a JSON path such as `artifacts[0].sha256`."""

    def __init__(self, schema: str, field: str, message: str):
        self.schema, self.field = schema, field
        super().__init__(f"{schema}: {field or '<root>'}: {message}")


def load(name: str) -> dict[str, Any]:
    """The schema document called `name` (one of SCHEMA_NAMES)."""
    return _documents()[name]


@lru_cache(maxsize=None)
def _documents() -> dict[str, dict[str, Any]]:
    root = resources.files(__name__)
    return {n: json.loads((root / f"{n}.schema.json").read_text()) for n in SCHEMA_NAMES}


@lru_cache(maxsize=None)
def _validator(name: str) -> jsonschema.protocols.Validator:
    docs = _documents()
    registry = Registry().with_resources(
        (f"{_BASE}{n}.schema.json", Resource.from_contents(d)) for n, d in docs.items()
    )
    cls = jsonschema.validators.extend(jsonschema.validators.validator_for(docs[name]), {"pattern": _pattern})
    return cls(docs[name], registry=registry, format_checker=cls.FORMAT_CHECKER)


@lru_cache(maxsize=None)
def _full(pattern: str) -> re.Pattern[str]:
    """JSON Schema patterns are ECMA-262, where `$` (no m flag) is the end of the input; Python's `$`
    also matches before a final newline, which let `c-...\\n` pass as an id. Anchor at `\\Z` instead."""
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def _pattern(validator, pattern: str, instance: Any, schema: dict) -> Any:
    if validator.is_type(instance, "string") and not _full(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _path(err: jsonschema.ValidationError) -> str:
    out = ""
    for part in err.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    if err.validator == "required":
        # name the missing field itself, not its parent
        missing = err.message.split("'")[1] if "'" in err.message else ""
        out = f"{out}.{missing}" if out else missing
    elif err.validator == "additionalProperties" and "'" in err.message:
        extra = err.message.split("'")[1]
        out = f"{out}.{extra}" if out else extra
    return out


def errors(name: str, obj: Any) -> list[SchemaError]:
    """Every violation of schema `name` in `obj`, most specific first."""
    found = sorted(_validator(name).iter_errors(obj), key=lambda e: (-len(e.absolute_path), e.message))
    return [SchemaError(name, _path(e), e.message) for e in found]


def validate(name: str, obj: Any) -> Any:
    """Return `obj` unchanged if it matches schema `name`, else raise the first SchemaError."""
    errs = errors(name, obj)
    if errs:
        raise errs[0]
    return obj
