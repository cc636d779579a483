"""gpulens alert rules: the rule files (the source of truth), the generator of the PrometheusRule
manifest, the promtool test scenarios, and PromQL helpers shared with the dashboards' tests.

Installed with the package: the rules, the manifest and the runbooks are package data, so
`python -m gpulens.alertrules.generate` and `gpulens up` work from a wheel as from the checkout.
"""

from pathlib import Path

__all__ = ["ruleset", "manifest", "promql", "scenarios", "promtool_tests", "RUNBOOKS_DIR"]

#: one Markdown runbook per diagnosis, linked from every alert's runbook_url
RUNBOOKS_DIR = Path(__file__).resolve().parent / "runbooks"
