"""The package's modules import each other in layers: no cycle, no arrow running back up
(leaves, backends, core, front ends, the package: the backends never import the modules
built on them, the core never a front end), and the core does not pull in Django or
Celery.

A cycle makes the import order matter (a module sees a half-initialised partner) and
hides which module owns a name; a function-level import that closes a cycle is still
one. Imports under ``if TYPE_CHECKING:`` never run, so they are left out. A package's
``__init__`` importing its own submodules is an ordinary edge like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import task_locks

PACKAGE = Path(task_locks.__file__).resolve().parent
ROOT_NAME = "task_locks"
#: Third-party frameworks only the integration packages may import.
FRAMEWORKS = ("celery", "django")
#: Where importing a framework is allowed (module name prefixes).
INTEGRATIONS = ("task_locks.celery",)
#: The backends' layer, and the leaf modules below it: all a backend may import from the
#: package. Locks, config, the CLI and Celery are built on backends, never the reverse.
BACKENDS = "task_locks.backends"
BELOW_BACKENDS = frozenset(
    {"task_locks.app_identity", "task_locks._steps", "task_locks.errors", "task_locks.types"}
)
#: The front ends, built on the core: the Celery package, the CLI and what it shares with
#: ``manage.py locks`` (verbs, listing, supervise), and the Prometheus metrics. Nothing of
#: the core imports them.
FRONT_ENDS = (
    "task_locks.celery",
    "task_locks.cli",
    "task_locks.listing",
    "task_locks.metrics",
    "task_locks.supervise",
    "task_locks.verbs",
)
#: The layers, bottom first; a module may import its own layer and those below it only.
LAYERS = ("leaves", "backends", "core", "front ends", "the package")


def layer(name: str) -> int:
    """The index in :data:`LAYERS` of module ``name``."""
    if name in BELOW_BACKENDS:
        return 0
    if name == BACKENDS or name.startswith(BACKENDS + "."):
        return 1
    if name == ROOT_NAME:
        return 4
    if any(name == front or name.startswith(front + ".") for front in FRONT_ENDS):
        return 3
    return 2


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs from a module to a layer above its own."""
    return sorted(
        f"{name} ({LAYERS[layer(name)]}) -> {target} ({LAYERS[layer(target)]})"
        for name, targets in edges.items()
        for target in targets
        if layer(target) > layer(name)
    )


def module_name(path: Path) -> str:
    parts = [ROOT_NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below ``node``, except the bodies of ``if TYPE_CHECKING``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def _parse(source: str, filename: str = "<test>") -> ast.Module:
    """``ast.parse``, once more after CPython 3.11's spurious "AST constructor recursion
    depth mismatch" SystemError (gh-106905, seen here under load), which is not about
    the source."""
    try:
        return ast.parse(source, filename)
    except SystemError:
        return ast.parse(source, filename)


def imported(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(modules of this package, top-level names of other packages) that ``name`` imports."""
    is_package = path.name == "__init__.py"
    inside: set[str] = set()
    outside: set[str] = set()
    for node in _imports(_parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one.
            subs = [f"{module}.{alias.name}" for alias in node.names]
            targets = [sub for sub in subs if sub in known] or [module]
            if len(targets) < len(subs) and module in known:
                targets.append(module)
        for target in targets:
            if target == ROOT_NAME or target.startswith(ROOT_NAME + "."):
                while target not in known:  # a name defined in a package: the package
                    target = target.rpartition(".")[0]
                if target != name:
                    inside.add(target)
            else:
                outside.add(target.partition(".")[0])
    return inside, outside


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    found = modules()
    known = set(found)
    edges: dict[str, set[str]] = {}
    third_party: dict[str, set[str]] = {}
    for name, path in found.items():
        edges[name], third_party[name] = imported(name, path, known)
    return edges, third_party


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that ends where it starts), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def test_the_graph_sees_the_package() -> None:
    edges, _ = graph()
    assert "task_locks.celery.task" in edges
    assert "task_locks.lock" in edges["task_locks.celery.task"]


def test_no_import_cycle_among_task_locks_modules() -> None:
    edges, _ = graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_arrow_runs_back_up_from_the_backends() -> None:
    edges, _ = graph()
    upward = {
        name: sorted(
            target
            for target in targets
            if not target.startswith(BACKENDS) and target not in BELOW_BACKENDS
        )
        for name, targets in edges.items()
        if name.startswith(BACKENDS)
    }
    assert {name: targets for name, targets in upward.items() if targets} == {}
    below = {name: sorted(edges[name]) for name in BELOW_BACKENDS if edges[name]}
    assert below == {}, "the leaf modules import nothing of the package"


def test_no_arrow_runs_back_up_the_layers() -> None:
    """Leaves, backends, core, front ends, the package: each imports only its own layer
    and those below (the backends never import config or a lock, the core never a front
    end, and no module the package's facade)."""
    edges, _ = graph()
    assert upward_arrows(edges) == []
    assert {LAYERS[layer(name)] for name in edges} == set(LAYERS), "every layer has modules"


def test_upward_arrows_finds_one_per_layer() -> None:
    edges = {
        "task_locks.backends.redis": {"task_locks.config", "task_locks.errors"},
        "task_locks.lock": {"task_locks.celery.task", "task_locks.backends.base"},
        "task_locks.errors": {"task_locks.types", "task_locks.backends"},
        "task_locks.cli": {"task_locks", "task_locks.verbs"},
    }
    assert upward_arrows(edges) == [
        "task_locks.backends.redis (backends) -> task_locks.config (core)",
        "task_locks.cli (front ends) -> task_locks (the package)",
        "task_locks.errors (leaves) -> task_locks.backends (backends)",
        "task_locks.lock (core) -> task_locks.celery.task (front ends)",
    ]


def test_core_never_imports_celery_or_django() -> None:
    _, third_party = graph()
    offenders = {
        name: sorted(set(FRAMEWORKS) & used)
        for name, used in third_party.items()
        if not name.startswith(INTEGRATIONS) and set(FRAMEWORKS) & used
    }
    assert offenders == {}


def test_type_checking_imports_are_left_out(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .b import X\n"
        "else:\n"
        "    from .c import Y\n"
        "def f():\n"
        "    from .d import Z\n"
    )
    found = [
        node.module
        for node in _imports(_parse(source))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert found == ["c", "d"]
