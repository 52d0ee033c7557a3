"""Where the suite's time goes, by test file (setup, call and teardown together).

`--durations` names the slowest single phases; a module-scoped fixture that runs a dozen
launches shows there as one setup, and a file of forty 5-second tests not at all. The sum
per file is what the README's budget is kept against.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

_SECONDS: defaultdict[str, float] = defaultdict(float)
SHOWN = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _SECONDS:
        return
    total = sum(_SECONDS.values())
    terminalreporter.section(f"time by test file (the {SHOWN} slowest of {len(_SECONDS)})")
    for path, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f}s in all test phases")
