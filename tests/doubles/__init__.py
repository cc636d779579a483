"""Protocol-faithful test doubles for components that are not run for real in tests."""
