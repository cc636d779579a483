"""The rule files as data: load them, name their alerts and records, render annotation templates.

The plain rule files under `alertrules/rules/` are the single source of truth; everything else
(the PrometheusRule manifest, the promtool tests, the dashboards' name checks) reads them here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["RULES_DIR", "RuleSet", "load", "render_template", "TemplateError"]

RULES_DIR = Path(__file__).resolve().parent / "rules"

_LABEL_REF = re.compile(r"\{\{\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


class TemplateError(ValueError):
    """An annotation uses more of Go's template language than `{{ $labels.x }}`."""


@dataclass(frozen=True)
class RuleSet:
    files: tuple[Path, ...]
    groups: tuple[dict[str, Any], ...]

    @property
    def alerts(self) -> tuple[dict[str, Any], ...]:
        return tuple(r for g in self.groups for r in g["rules"] if "alert" in r)

    @property
    def records(self) -> tuple[dict[str, Any], ...]:
        return tuple(r for g in self.groups for r in g["rules"] if "record" in r)

    @property
    def alert_names(self) -> tuple[str, ...]:
        return tuple(sorted({r["alert"] for r in self.alerts}))

    @property
    def record_names(self) -> tuple[str, ...]:
        return tuple(sorted({r["record"] for r in self.records}))

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g["name"] for g in self.groups)

    def alert(self, name: str) -> dict[str, Any]:
        matches = [r for r in self.alerts if r["alert"] == name]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} alerting rules named {name!r}")
        return matches[0]

    def expressions(self) -> list[tuple[str, str]]:
        """(rule name, expr) for every rule."""
        return [(r.get("alert") or r["record"], r["expr"]) for g in self.groups for r in g["rules"]]


def load(rules_dir: Path = RULES_DIR) -> RuleSet:
    files = tuple(sorted(rules_dir.glob("*.rules.yml")))
    if not files:
        raise FileNotFoundError(f"no *.rules.yml in {rules_dir}")
    groups: list[dict[str, Any]] = []
    for path in files:
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
            raise ValueError(f"{path}: not a Prometheus rule file (no top-level 'groups' list)")
        groups.extend(doc["groups"])
    return RuleSet(files=files, groups=tuple(groups))


def render_template(text: str, labels: dict[str, str]) -> str:
    """Render an annotation the way Prometheus does, for templates that use only `$labels.x`.

    The rules keep annotations to label references on purpose: their rendering is then exact and
    the promtool tests can state every annotation of every expected alert.
    """
    rendered = _LABEL_REF.sub(lambda m: labels.get(m.group(1), ""), text)
    if "{{" in rendered or "}}" in rendered:
        raise TemplateError(f"annotation uses more than {{{{ $labels.x }}}}: {text!r}")
    return rendered
