"""The suite's shared fixtures live in tests/support/fixtures.py (one place, every folder);
tests/support/timing.py prints where the time went, file by file."""

pytest_plugins = ["tests.support.fixtures", "tests.support.timing"]
