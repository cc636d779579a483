"""gpulens alert rules: the rule files (the source of truth), the generator of the PrometheusRule
manifest, the promtool test scenarios, and PromQL helpers shared with the dashboards' tests.

A folder of data and scripts, not an installed package: run its tools from the repository root
(`python -m alertrules.generate`, `python -m alertrules.promtool_tests`).
"""

__all__ = ["ruleset", "manifest", "promql", "scenarios", "promtool_tests"]
