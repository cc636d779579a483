"""Talking to Kineto's on-demand machinery: dynolog's RPC, the IPC fabric, and the config text.

- `DynologClient`: stock dynolog's TCP JSON RPC (`setKinetOnDemandRequest`, `getVersion`, ...).
- `KinetoEndpoint`: the builtin trigger, answering Kineto's IPC polls where no dynolog runs.
- `build_config` / `TraceConfig`: the Kineto config text, validated before it is sent.
- `OnDemandResult` / `PidOutcome`: what a trigger achieved per pid, said no more strongly than seen.

Facts and citations: shared/reference/dynolog-kineto-protocol.md and dynolog-observed.md.
"""

from .config import (MIN_START_LEAD_MS, KinetoConfigError, TraceConfig, build_config, kineto_trace_path, log_file_for,
                     tick_aligned_start_ms)
from .ipc_server import Delivery, EndpointBusy, KinetoEndpoint
from .kineto_watch import KinetoOutcome
from .results import DynologRefused, OnDemandResult, PidOutcome, TriggerFailed
from .rpc import DynologClient

__all__ = [
    "MIN_START_LEAD_MS", "KinetoConfigError", "TraceConfig", "build_config", "kineto_trace_path", "log_file_for",
    "tick_aligned_start_ms",
    "Delivery", "EndpointBusy", "KinetoEndpoint", "KinetoOutcome",
    "OnDemandResult", "PidOutcome", "TriggerFailed", "DynologRefused", "DynologClient",
]
