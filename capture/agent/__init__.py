"""agent (see docs/ARCHITECTURE.md)."""
