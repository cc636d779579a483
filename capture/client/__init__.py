"""client (see docs/ARCHITECTURE.md)."""
