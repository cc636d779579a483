"""gateway (see docs/ARCHITECTURE.md)."""
