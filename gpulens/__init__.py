"""gpulens: GPU demand, back-pressure and contention signals plus on-demand multi-rank captures.

This package holds the command line (`gpulens.cli`), the embedded default (`gpulens.up`) and the
small layer shared by every component (`gpulens.ground.logs`). The components themselves live in the
top-level packages `exporter`, `capture` and `hooks`.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
