"""gpulens: GPU demand, back-pressure and contention signals plus on-demand multi-rank captures.

The one import namespace of the distribution: the command line (`gpulens.cli`), the embedded default
(`gpulens.up`), the rules and dashboards (`gpulens.alertrules`, `gpulens.dashboards`), the two planes
(`gpulens.exporter`, `gpulens.capture`), the trainer hook (`gpulens.hooks`) and the ground every
component stands on (`gpulens.ground`). The planes, rules, dashboards and hook live in the repository's
top-level folders (exporter/, capture/, ...), which pyproject.toml maps to these names;
docs/ARCHITECTURE.md ("Folders and layers") maps them.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
