"""The import layers of the four packages, checked whole by `tests.support.layers`.

The ground order: `events` and `traces` import nothing of ours, `states` imports only
`events`, `runtime` may import all three; `events`, `states` and `traces` never import ray or
torch. Inside ``runtime/`` each folder imports only those before it in `RUNTIME_ORDER`. The
checker reads the source with `ast` (nothing is imported) and refuses:

- an import that breaks the ground order or the runtime order;
- a relative import (``from . import x``, ``from .x import y``): every import names its
  absolute ``sft_runtime.…`` path, so a reader and the checker see where it points;
- an import of ours under ``if TYPE_CHECKING:`` (either branch): a tie made for types only
  is still a tie, so the lower module takes plain values or a Protocol it defines itself;
- a string import of ours: ``import_module``/``__import__`` given a name in our namespace (or
  a relative one), or any string constant that is exactly one of our modules' dotted names
  (a table of modules to import later), since the import statements are what is checked;
- an import cycle among all modules of the four packages.

What counts as an import: every ``import`` and ``from`` statement, wherever it stands
(inside functions and classes, under ``try`` or ``if TYPE_CHECKING:``), for the layers and
for cycles alike. A cycle through a function-local import is a cycle: the local import only
moves the circular load to the first call, and neither module can be read or replaced
without the other. An edge goes to the module a statement names (``from pkg import mod``
names ``pkg.mod``; ``from pkg.mod import name`` names ``pkg.mod``); the package
``__init__`` that Python runs before a submodule is not an edge of its own.

The tests mirror the packages: each folder of ``tests/unit`` and ``tests/integration`` is
named for the package whose behaviour its tests assert (``events``, ``states``, ``traces``
or a unit of `RUNTIME_ORDER`), so the tests of a package are found in one place and a
package without a folder is seen to have none. The only other folders are the cross-cutting
suites of `CROSS_CUTTING_TESTS` (tests/integration's ``multinode``, ``perf`` and
``real_model``), which exercise many packages together. Modules at the root of a suite test
no package (this checker; the wheel's packaging; bench/'s scale plan).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.layers import (
    CROSS_CUTTING_TESTS,
    GROUND,
    RUNTIME_ORDER,
    TEST_SUITES,
    folder_violations,
    layer_violations,
    read_modules,
    runtime_units,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_runtime_is_in_the_order():
    assert runtime_units(ROOT) == set(RUNTIME_ORDER)


def test_the_checker_reads_every_package():
    """Not a vacuous pass: each of the four packages is found, with its imports."""
    modules = read_modules(ROOT)
    for package in GROUND:
        found = [m for m in modules.values() if m.package == package]
        assert found and any(m.imports for m in found), package


def test_the_four_packages_keep_their_layers():
    assert layer_violations(ROOT) == []


@dataclass(frozen=True)
class Plant:
    """A violation appended to a copy of a real module: ``text``, whose line ``at`` (1 for
    its first) is the culprit, and the start of the line the checker must give, with
    ``{at}`` standing for 'file:line'."""

    file: str
    text: str
    at: int
    expected: str


PLANTS = {
    "events imports states": Plant(
        "events/log.py",
        "def _planted():\n    from sft_runtime.states import fold\n",
        2,
        "{at}: layers: events imports sft_runtime.states (states); "
        "events may import nothing of ours",
    ),
    "events imports traces": Plant(
        "events/schemas.py",
        "from sft_runtime.traces.context import TRACER\n",
        1,
        "{at}: layers: events imports sft_runtime.traces.context (traces); "
        "events may import nothing of ours",
    ),
    "traces imports events": Plant(
        "traces/spans.py",
        "import sft_runtime.events.log\n",
        1,
        "{at}: layers: traces imports sft_runtime.events.log (events); "
        "traces may import nothing of ours",
    ),
    "states imports traces": Plant(
        "states/fold.py",
        "from sft_runtime.traces import TRACER\n",
        1,
        "{at}: layers: states imports sft_runtime.traces (traces); states may import only events",
    ),
    "a runtime folder imports one above it": Plant(
        "runtime/data/batch.py",
        "def _planted():\n    from sft_runtime.runtime.controller.loop import SFTController\n",
        2,
        "{at}: runtime order: data imports sft_runtime.runtime.controller.loop (controller)",
    ),
    "relative import of a module": Plant(
        "states/fold.py",
        "from .machine import STATES\n",
        1,
        "{at}: relative import: `from .machine import STATES`; "
        "write `from sft_runtime.states.machine import STATES`",
    ),
    "relative import of the package": Plant(
        "runtime/controller/loop.py",
        "from . import saving\n",
        1,
        "{at}: relative import: `from . import saving`; "
        "write `from sft_runtime.runtime.controller import saving`",
    ),
    "TYPE_CHECKING import": Plant(
        "runtime/controller/loop.py",
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from sft_runtime.events.log import EventLog\n",
        4,
        "{at}: TYPE_CHECKING import: sft_runtime.events.log is ours",
    ),
    "import_module string": Plant(
        "runtime/metrics/step_metrics.py",
        "def _planted():\n    import importlib\n\n"
        '    return importlib.import_module("sft_runtime.runtime.workers.results")\n',
        4,
        "{at}: string import: 'sft_runtime.runtime.workers.results' names a module of ours",
    ),
    "__import__ string": Plant(
        "events/log.py",
        'def _planted():\n    return __import__("sft_runtime.states.fold")\n',
        2,
        "{at}: string import: 'sft_runtime.states.fold' names a module of ours",
    ),
    "a table of module names": Plant(
        "traces/__init__.py",
        '_PLANTED = {"setup_telemetry": "sft_runtime.traces.setup"}\n',
        1,
        "{at}: string import: 'sft_runtime.traces.setup' names a module of ours",
    ),
    "a cycle through a function-local import": Plant(
        "runtime/data/chat_format.py",
        "def _planted():\n    from sft_runtime.runtime.data.tokenizer import ByteTokenizer\n",
        2,
        "runtime/data/chat_format.py: import cycle: sft_runtime.runtime.data.chat_format ({at}) "
        "-> sft_runtime.runtime.data.tokenizer (runtime/data/tokenizer.py:",
    ),
    "torch in states": Plant("states/machine.py", "import torch\n", 1, "{at}: no ray or torch"),
}


def _copy_tree(tmp_path: Path) -> Path:
    for package in GROUND:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    return tmp_path


@pytest.mark.parametrize("plant", PLANTS.values(), ids=PLANTS.keys())
def test_the_checker_fails_on_a_planted_violation(tmp_path, plant):
    """Each violation, written into a copy of a real module of a copy of the four packages,
    fails the checker with a line that names the file, the line and the rule; every line it
    gives names the planted file (the copy is otherwise clean)."""
    root = _copy_tree(tmp_path)
    path = root / plant.file
    source = path.read_text()
    if not source.endswith("\n"):
        source += "\n"
    path.write_text(source + "\n" + plant.text)
    at = f"{plant.file}:{len(source.splitlines()) + 1 + plant.at}"
    found = layer_violations(root)
    expected = plant.expected.format(at=at)
    assert any(line.startswith(expected) for line in found), (expected, found)
    assert all(plant.file in line for line in found), found


def test_test_folders_mirror_the_packages():
    assert folder_violations(ROOT) == []


def test_the_folder_checker_reads_every_suite():
    """Not a vacuous pass: both suites are found, each with folders named for packages."""
    for suite in TEST_SUITES:
        folders = {p.name for p in (ROOT / "tests" / suite).iterdir() if p.is_dir()}
        assert folders & {"data", "policy"}, suite
        assert set(CROSS_CUTTING_TESTS[suite]) <= folders, suite


FOLDER_PLANTS = {
    "a folder named for no package": "tests/unit/helpers",
    "a folder named for a file of a package": "tests/integration/loop",
    "a cross-cutting suite of the other suite": "tests/unit/multinode",
    "the runtime package as a whole": "tests/unit/runtime",
}


def _copy_suites(tmp_path: Path) -> Path:
    for suite in TEST_SUITES:
        shutil.copytree(
            ROOT / "tests" / suite,
            tmp_path / "tests" / suite,
            ignore=shutil.ignore_patterns("*.pyc", "__pycache__"),
        )
    return tmp_path


@pytest.mark.parametrize("folder", FOLDER_PLANTS.values(), ids=FOLDER_PLANTS.keys())
def test_the_folder_checker_fails_on_a_planted_folder(tmp_path, folder):
    """A folder of tests, planted in a copy of both suites, fails the checker with one line
    that names it; the copy is otherwise clean."""
    root = _copy_suites(tmp_path)
    planted = root / folder
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    (planted / "test_planted.py").write_text("def test_planted():\n    pass\n")
    found = folder_violations(root)
    assert len(found) == 1 and found[0].startswith(f"{folder}: test folders: "), found
