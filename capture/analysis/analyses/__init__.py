"""One module per analysis, each `ANALYSIS = Analysis(name, title, applies, run)`; order is report order."""

from . import annotations, cpu_ops, idle, iterations, kernels, launches, overlap, stragglers, temporal
from .base import Analysis

__all__ = ["Analysis", "DEFAULT_ANALYSES"]

DEFAULT_ANALYSES: tuple[Analysis, ...] = (
    temporal.ANALYSIS, kernels.ANALYSIS, overlap.ANALYSIS, idle.ANALYSIS, launches.ANALYSIS,
    stragglers.ANALYSIS, iterations.ANALYSIS, cpu_ops.ANALYSIS, annotations.ANALYSIS,
)
