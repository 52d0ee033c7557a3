"""Where the suite's time goes, by test file (setup, call and teardown together), and the
longest files first.

`--durations` names the slowest single phases; a module-scoped fixture that runs a dozen
launches shows there as one setup, and a file of forty 5-second tests not at all. The sum
per file is what the README's budget is kept against.

`make test` runs two files at a time (pytest-xdist, ``--dist loadfile``), handing them out
in collection order; the files that take longest are moved to the front so that the two
workers end together rather than one running a 4-minute file alone at the end.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

_SECONDS: defaultdict[str, float] = defaultdict(float)
SHOWN = 15
# the files over a minute in the last measured run, longest first (README, "How long the
# tests take"); a file missing from here only starts later
LONGEST_FIRST = (
    "tests/reliability/test_kill_points.py",
    "tests/integration/perf/test_bench_smoke.py",
    "tests/integration/lora/test_lora_runs.py",
    "tests/reliability/test_random_kills.py",
    "tests/integration/policy/test_hf_sharded_start.py",
    "tests/integration/real_model/test_real_model.py",
    "tests/reliability/test_bad_input.py",
    "tests/integration/traces/test_span_ids.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the longest files' tests to the front, each file's tests kept in their order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _SECONDS:
        return
    total = sum(_SECONDS.values())
    terminalreporter.section(f"time by test file (the {SHOWN} slowest of {len(_SECONDS)})")
    for path, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
    at_once = getattr(config.option, "numprocesses", None)  # pytest-xdist's -n
    summed = f" (summed over {at_once} workers that ran them at once)" if at_once else ""
    terminalreporter.write_line(f"{total:8.1f}s in all test phases{summed}")
