#!/usr/bin/env python3
"""Copy the generated alert rules and dashboards into the chart's files/ (the chart cannot read
outside its own folder). Run after regenerating alertrules/ or dashboards/:

    python helm/gpulens/hack/sync_files.py            # write helm/gpulens/files/
    python helm/gpulens/hack/sync_files.py --check    # exit 1 when the chart's copies are stale

Sources: the `spec` of alertrules/kubernetes/gpulens-prometheusrule.yaml (the generated
PrometheusRule) becomes files/rules.yaml; dashboards/**/*.json (generated JSON) become
files/dashboards/<name>.json. A missing source leaves the chart's copy as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parent.parent
REPO = CHART.parent.parent
RULES_SOURCE = REPO / "alertrules" / "kubernetes" / "gpulens-prometheusrule.yaml"
DASHBOARDS_SOURCE = REPO / "dashboards"
HEADER = "# Copied by helm/gpulens/hack/sync_files.py from alertrules/kubernetes/gpulens-prometheusrule.yaml: do not edit.\n"


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v,
                                                              style="|" if "\n" in v else None))


def rules_text(source: Path = RULES_SOURCE) -> str | None:
    if not source.is_file():
        return None
    doc = yaml.safe_load(source.read_text())
    if not isinstance(doc, dict) or doc.get("kind") != "PrometheusRule":
        raise SystemExit(f"{source}: not a PrometheusRule manifest")
    return HEADER + yaml.dump({"groups": doc["spec"]["groups"]}, Dumper=_Dumper, sort_keys=False, width=1000,
                              allow_unicode=True)


def dashboard_sources(root: Path = DASHBOARDS_SOURCE) -> dict[str, Path]:
    """Generated dashboard JSON by file name (a Grafana dashboard has `panels` and a `uid`)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and "panels" in doc and "uid" in doc:
            out[path.name] = path
    return out


def planned(chart: Path = CHART) -> dict[Path, str]:
    """{chart file: wanted content} for every source that exists."""
    out: dict[Path, str] = {}
    rules = rules_text()
    if rules is not None:
        out[chart / "files" / "rules.yaml"] = rules
    for name, path in dashboard_sources().items():
        out[chart / "files" / "dashboards" / name] = path.read_text()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a chart copy differs from its source")
    args = ap.parse_args(argv)
    stale = []
    for path, text in planned().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {path.relative_to(REPO)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
