"""Capture annotations: a Grafana client, a local sink for the embedded mode, and a retrying sync.

The coordinator describes what an annotation should say (`Annotation`); `AnnotationSync` keeps
trying until the sink says the same, so an unreachable Grafana delays an annotation but never a
capture, and the sync's state (synced / retrying / failed, with the last error) is visible in the
capture's status.
"""

from .model import Annotation, AnnotationError, AnnotationGone, AnnotationSink
from .grafana import GrafanaSink
from .filesink import FileSink
from .syncing import AnnotationSync
from .render import capture_annotation, report_link

__all__ = ["Annotation", "AnnotationError", "AnnotationGone", "AnnotationSink", "GrafanaSink", "FileSink",
           "AnnotationSync", "capture_annotation", "report_link"]
