"""capture package."""
