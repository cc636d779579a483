"""The metric catalogue (exporter/metrics.yaml) as data, and the only way to make a family.

Collectors build every family through `Catalogue.family(name)`, so a metric that is not in the
catalogue, or a sample with labels other than the catalogue's, fails loudly in tests instead of
silently diverging from what the alert rules and dashboards expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["MetricSpec", "Catalogue", "CATALOGUE_PATH", "load_catalogue"]

CATALOGUE_PATH = Path(__file__).parent / "metrics.yaml"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    source: str
    unit: str = ""


class Catalogue:
    def __init__(self, specs: list[MetricSpec]):
        self.specs = {s.name: s for s in specs}

    def family(self, name: str):
        spec = self.specs[name]
        cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
        return _Checked(cls(spec.name, spec.help, labels=list(spec.labels), unit=spec.unit), spec)


class _Checked:
    """A family that refuses samples whose label values don't line up with the catalogue."""

    def __init__(self, family, spec: MetricSpec):
        self.family, self.spec = family, spec

    def add(self, labels: list[str], value: float) -> None:
        if len(labels) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name}: {len(labels)} label values for {self.spec.labels}")
        self.family.add_metric([str(v) for v in labels], value)


def load_catalogue(path: Path = CATALOGUE_PATH) -> Catalogue:
    data = yaml.safe_load(Path(path).read_text())
    specs = []
    for m in data["metrics"]:
        if m["type"] not in ("counter", "gauge"):
            raise ValueError(f"{m['name']}: unsupported type {m['type']}")
        specs.append(MetricSpec(name=m["name"], type=m["type"], labels=tuple(m.get("labels", [])),
                                help=m["help"], source=m["source"], unit=m.get("unit", "")))
    return Catalogue(specs)
