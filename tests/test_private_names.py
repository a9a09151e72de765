"""No module outside ``task_locks/`` names a private attribute of another module's object:
django_app/, bench/, example_project/ and the tests' helper modules use task-locks (and
each other) by public names only, so a change behind an underscore breaks nothing there.

Read from the source (AST), per module: ``obj._name`` where ``obj`` is not ``self`` or
``cls`` and ``_name`` is none of the module's own (a function, class, argument, variable
or attribute it defines or assigns), ``from module import _name``, and an import of a
private module (``task_locks._steps``). Dunders are not private, nor the underscore names
that are another library's public API (namedtuple's ``_replace``, Django's ``_meta``).
``getattr(obj, "_name")`` is not seen. Test modules themselves may look inside what they
test.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Folders whose every module is read; under tests/ only the helpers (not test_*.py).
SCANNED = ("django_app", "bench", "example_project", "tests")
#: Public API spelled with one underscore, by the library that defines it.
CONVENTIONAL = frozenset({"_asdict", "_fields", "_make", "_replace", "_meta", "_exit", "_getframe"})
#: Modules that work inside task-locks' private parts by design, and why.
WHITE_BOX = {
    "tests/sim": "the simulator runs the real lease on virtual time: it patches the renewal "
    "lane and reads the lease's private state",
    "bench/celery_profile.py": "profiles the private steps of one singleton run, by name",
    "tests/beat_driver.py": "explains a beat timeout from Celery's scheduler heap (its "
    "_heap and _when, which Celery offers no public way to read)",
    "bench/.peers": "another project's virtualenv",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in CONVENTIONAL


def _own_names(tree: ast.Module) -> set[str]:
    """What the module itself defines or assigns: its own objects' private names."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return own


def private_uses(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each private name of another module's object in ``source``."""
    tree = ast.parse(source)
    own = _own_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                yield node.lineno, f"from {module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"from {'.' * node.level}{module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name}"


def scanned() -> Iterator[Path]:
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if any(relative == p or relative.startswith(p + "/") for p in WHITE_BOX):
                continue
            if folder == "tests" and path.name.startswith("test_"):
                continue
            yield path


def test_no_module_outside_the_package_names_another_modules_private_attribute() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in scanned()
        for line, what in private_uses(path.read_text())
    ]
    assert found == []


def test_the_scan_sees_modules_of_every_folder() -> None:
    seen = {path.relative_to(ROOT).parts[0] for path in scanned()}
    assert seen == set(SCANNED)
    names = {path.relative_to(ROOT).as_posix() for path in scanned()}
    assert "tests/servers.py" in names and "django_app/checks.py" in names
    assert "tests/core/test_import_layers.py" not in names


def test_private_uses_finds_each_kind_and_leaves_own_names_alone() -> None:
    source = (
        "import task_locks._steps\n"
        "from task_locks._plan import Op\n"
        "from deployments import _have, build\n"
        "from task_locks import events\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._x = 1\n"
        "    def look(self, other):\n"
        "        return other._x, self._y, events._hub, cls._z\n"
        "point = point._replace(x=1)\n"
        "model._meta, obj.__dict__\n"
    )
    assert [what for _, what in private_uses(source)] == [
        "import task_locks._steps",
        "from task_locks._plan import ...",
        "from deployments import _have",
        "events._hub",
    ]
