"""Operator configuration: one YAML file (rendered by the chart), validated, then frozen dataclasses.

A file rather than twenty flags because the same settings feed three things (the coordinators it
creates, the webhook's arming patch and leader election) and the chart keeps them in one ConfigMap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

__all__ = ["ArmingConfig", "CoordinatorConfig", "LeaderElectionConfig", "OperatorConfig", "OperatorConfigError",
           "load_config"]

_SCHEMA = json.loads((Path(__file__).with_name("config.schema.json")).read_text())


class OperatorConfigError(ValueError):
    """The configuration file is unreadable or breaks config.schema.json (the message names the field)."""


@dataclass(frozen=True)
class ArmingConfig:
    """What the webhook (and the documented snippet) add to a trainer pod."""
    hook_image: str = ""                         # empty: the operator's own image
    registry_dir: str = "/var/lib/gpulens/registry"
    trace_dir: str = "/var/lib/gpulens/traces"
    socket_dir: str = "/run/gpulens"             # short: Kineto appends socket names (sun_path is 108 bytes)
    hook_mount_path: str = "/opt/gpulens/hook"


@dataclass(frozen=True)
class CoordinatorConfig:
    archive_root: str
    port: int = 9452
    agent_url_template: str = "http://{node_ip}:9451"
    s3_endpoint: str = ""
    archive_secret: str = ""
    grafana_url: str = ""
    analysis: str = "job"                        # job: `gpulens analyze` as a batch/v1 Job; local: a child process
    analysis_resources: Mapping[str, Any] = field(default_factory=dict)
    analysis_timeout_s: float = 1800.0
    analysis_ttl_s: int = 3600
    budget_mb: int = 200                         # --budget-mb (coordinator/command.py's defaults, one place each)
    start_lead_s: float = 12.0                   # --start-lead-s
    wall_start_lead_s: float = 16.0              # --wall-start-lead-s
    analysis_scheduler: str = ""                 # tcp://...: analysis Jobs submit ranks to this Dask cluster
    cluster_role: str = "gpulens-coordinator"
    service_account_annotations: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str = ""
    capture_defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaderElectionConfig:
    enabled: bool = True
    lease_name: str = "gpulens-operator"
    lease_duration_s: float = 15.0
    renew_period_s: float = 5.0


@dataclass(frozen=True)
class OperatorConfig:
    namespace: str
    image: str
    tokens_secret: str
    coordinator: CoordinatorConfig
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    resync_interval_s: float = 60.0
    leader_election: LeaderElectionConfig = field(default_factory=LeaderElectionConfig)
    arming: ArmingConfig = field(default_factory=ArmingConfig)

    @property
    def hook_image(self) -> str:
        return self.arming.hook_image or self.image

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OperatorConfig":
        try:
            jsonschema.validate(dict(data), _SCHEMA)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
            raise OperatorConfigError(f"operator config: {where}: {exc.message}") from None
        d = dict(data)
        coord = dict(d.pop("coordinator"))
        coord["tolerations"] = tuple(coord.get("tolerations", ()))
        return cls(
            coordinator=CoordinatorConfig(**coord),
            leader_election=LeaderElectionConfig(**d.pop("leader_election", {})),
            arming=ArmingConfig(**d.pop("arming", {})),
            image_pull_secrets=tuple(d.pop("image_pull_secrets", ())),
            **d,
        )


def load_config(path: str | Path) -> OperatorConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise OperatorConfigError(f"operator config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise OperatorConfigError(f"operator config {path}: expected a mapping at the top level")
    return OperatorConfig.from_dict(data)
