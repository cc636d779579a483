"""operator (see docs/ARCHITECTURE.md)."""
