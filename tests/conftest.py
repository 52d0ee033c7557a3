"""The suite's shared fixtures live in tests/support/fixtures.py (one place, every folder)."""

pytest_plugins = ["tests.support.fixtures"]
