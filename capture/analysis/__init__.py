"""Capture analysis: a manifest in, HolisticTraceAnalysis over exactly the files it names, a report out.

`analyze_manifest(uri, AnalyzeOptions(...))` is the façade; the analyses themselves are stateless
modules under `gpulens.capture.analysis.analyses` (one per analysis, each `applies` + `run` over HTA), and
the report is rendered from summary.json alone. HTA and pandas are imported only when there is
something to analyse, so refusing a bad manifest is instant.
"""

from .facade import REPORT_KEY, SUMMARY_KEY, AnalysisRun, AnalyzeOptions, analyze_manifest
from .manifest_reading import ManifestRefused

__all__ = ["analyze_manifest", "AnalyzeOptions", "AnalysisRun", "ManifestRefused", "SUMMARY_KEY", "REPORT_KEY"]
