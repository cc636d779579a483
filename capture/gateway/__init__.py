"""The gateway (`gpulens gateway`, docs/gateway.md): Alertmanager webhook and manual requests,
routed to the right job's coordinator; idempotent per alert episode, with a per-job cooldown."""

from .alertmanager import AUTO_LABEL, JOB_LABEL, Alert, PayloadError, parse_payload
from .handling import Gateway, GatewaySettings, Outcome
from .ledger import Ledger
from .routing import Route, Router, Unroutable, parse_route
from .server import make_app

__all__ = ["AUTO_LABEL", "JOB_LABEL", "Alert", "PayloadError", "parse_payload", "Gateway", "GatewaySettings",
           "Outcome", "Ledger", "Route", "Router", "Unroutable", "parse_route", "make_app"]
