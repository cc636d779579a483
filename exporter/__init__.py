"""The gpulens exporter: per-pod GPU demand, back-pressure and contention for Prometheus.

Signals come from eBPF uprobes on the CUDA driver library (counted in BPF maps, read at scrape),
NVML (processes per GPU) and a node-local dcgm-exporter; processes are attributed to pods through
their cgroup and the Kubernetes API, or through the trainer hook's registration records.
"""

from .config import ExporterConfig
from .service import Exporter

__all__ = ["Exporter", "ExporterConfig"]
