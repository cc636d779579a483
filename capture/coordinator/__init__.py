"""The per-(job, attempt) capture coordinator (`gpulens coordinator`, docs/coordinator.md).

Prepare (discovery -> frozen snapshot), dispatch to node agents at-least-once, converge by
pulling level-triggered statuses, write the manifest, run analysis, keep the annotation in step.
"""

from .agents import AgentFleet, AgentRefused, AgentUnavailable
from .deadlines import DeadlinePolicy, Deadlines, DelayTracker
from .discovery import AgentUrls, Discovery, DiscoveryError, LocalDiscovery
from .fanout import FanoutSettings
from .progress import CaptureRecord, Phase
from .server import make_app
from .service import CaptureBusy, Coordinator, CoordinatorSettings
from .targets import PodFacts, Snapshot, Target, expand

__all__ = ["AgentFleet", "AgentRefused", "AgentUnavailable", "DeadlinePolicy", "Deadlines", "DelayTracker",
           "AgentUrls", "Discovery", "DiscoveryError", "LocalDiscovery", "FanoutSettings", "CaptureRecord", "Phase",
           "make_app", "CaptureBusy", "Coordinator", "CoordinatorSettings", "PodFacts", "Snapshot", "Target", "expand"]
