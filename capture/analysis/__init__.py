"""analysis (see docs/ARCHITECTURE.md)."""
