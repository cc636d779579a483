"""gpulens Grafana dashboards as code (grafana-foundation-sdk), committed as JSON in json/.

A folder of scripts and data, not an installed package: `python -m gpulens.dashboards.build` from the
repository root regenerates json/*.json; a test regenerates and compares.
"""

__all__ = ["build", "panels"]
