"""up (see docs/ARCHITECTURE.md)."""
