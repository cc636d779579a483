"""Kubernetes RBAC evaluation for tests: which (apiGroup, resource, verb, namespace, name) a REST
request needs, and whether a set of Role/ClusterRole rules grants it. Follows the API server's
request-info rules (k8s.io/apiserver RequestInfoFactory): GET on a collection is `list` (or
`watch` with ?watch=true), GET on an object `get`, POST `create`, PUT `update`, PATCH `patch`,
DELETE `delete`; subresources are `resource/subresource`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs


@dataclass(frozen=True)
class Attributes:
    group: str
    resource: str
    verb: str
    namespace: str | None
    name: str | None


def attributes(method: str, path: str, query: str = "") -> Attributes | None:
    """None for non-resource URLs (discovery: /api, /apis, /version), which every user may read."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    watch = parse_qs(query).get("watch", [""])[0] in ("true", "1")
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if watch else ("get" if name else "list")
    return Attributes(group, resource, verb, namespace, name)


def _rule_allows(rule: dict, a: Attributes) -> bool:
    return (a.group in rule.get("apiGroups", []) and a.resource in rule.get("resources", [])
            and a.verb in rule.get("verbs", [])
            and (not rule.get("resourceNames") or (a.name is not None and a.name in rule["resourceNames"])))


def allowed(a: Attributes, cluster_rules: list[dict], namespaced_rules: dict[str, list[dict]]) -> bool:
    if any(_rule_allows(r, a) for r in cluster_rules):
        return True
    return a.namespace is not None and any(_rule_allows(r, a) for r in namespaced_rules.get(a.namespace, []))
