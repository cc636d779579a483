"""coordinator (see docs/ARCHITECTURE.md)."""
