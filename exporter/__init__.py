"""exporter package."""
