"""Typed views of the capture contracts (the JSON Schemas in `gpulens.capture.schemas` are the wire truth).

Every `from_dict` validates against the schema first, so a model instance is always valid input;
every `to_dict` produces exactly what the schema accepts.
"""

from .registration import RegistrationRecord
from .request import CaptureOptions, CaptureReason, CaptureRequest, new_capture_id
from .states import FailureReason, TargetState, TargetStatus, TERMINAL_STATES, TriggerAttempt
from .budget import TraceBudget
from .dispatch import Dispatch
from .manifest import Artifact, ExpectedTarget, Failure, Manifest, target_id_for_rank
from .steps import StepReading

__all__ = [
    "RegistrationRecord", "CaptureOptions", "CaptureReason", "CaptureRequest", "new_capture_id",
    "FailureReason", "TargetState", "TargetStatus", "TERMINAL_STATES", "TriggerAttempt", "Dispatch", "TraceBudget",
    "Artifact", "ExpectedTarget", "Failure", "Manifest", "target_id_for_rank", "StepReading",
]
