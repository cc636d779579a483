"""The `gpulens capture` CLI and the async capture-API client it shares with the gateway."""

from .api import ApiError, ApiUnavailable, CaptureApi
from .render import EXIT_COULD_NOT_RUN, EXIT_FAILURES, EXIT_OK, verdict

__all__ = ["ApiError", "ApiUnavailable", "CaptureApi", "EXIT_COULD_NOT_RUN", "EXIT_FAILURES", "EXIT_OK", "verdict"]
