"""The Celery package uses only what the core and the task declare for it.

What :mod:`task_locks.celery` may do to a lease or a lock beyond the public API is
:mod:`task_locks._friends` (``FriendLease``, ``acquire_under``); what its lower modules may
use of a singleton task is ``LockingTask`` (public methods and options). So no module of
the package names a private attribute (one leading underscore) that it does not define
itself: not ``lease._hand_over``, not ``task._lock_name``, not an inherited
``self._lock_options()`` or ``super()._run_lock()``, and it imports no private name of
another module. The rule and its AST reading are ``tests/test_private_names.py``'s (for
the modules outside the package), with ``self``/``cls``/``super()`` read too: a subclass in
another module of the package must not lean on its parent's private members.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_private_names import _own_names, _private, private_uses

import task_locks.celery

PACKAGE = Path(task_locks.celery.__file__).resolve().parent
#: Private modules the package imports by design: its own shared modules, and the core's
#: doors for the front ends (the friend declarations, the plan drivers).
FRIEND_MODULES = frozenset({"_common", "_celery_compat", "_friends", "_steps"})
#: Private names of other libraries that the package reads on purpose, and why.
ALLOWED = {
    ("publish.py", "self.app._tasks"): "Celery's task registry, read as send_task reads it: "
    "app.tasks would finalize the app from inside a publish",
}


def _inherited(tree: ast.Module) -> list[tuple[int, str]]:
    """``self._x``, ``cls._x`` and ``super()._x`` whose ``_x`` the module does not define."""
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        value = ast.unparse(node.value)
        if value == "super()" or (value in ("self", "cls") and node.attr not in own):
            found.append((node.lineno, ast.unparse(node)))
    return found


def reaches(path: Path) -> list[str]:
    """``file:line: what`` for each private name of another module that ``path`` uses."""
    source = path.read_text()
    uses = [*private_uses(source), *_inherited(ast.parse(source))]
    found = []
    for line, what in sorted(uses):
        words = what.split()
        if words[0] == "from" and words[-1] == "..." and words[1].lstrip(".") in FRIEND_MODULES:
            continue
        if (path.name, what) not in ALLOWED:
            found.append(f"{path.name}:{line}: {what}")
    return found


def test_the_celery_package_names_no_private_attribute_of_another_module() -> None:
    found = [line for path in sorted(PACKAGE.glob("*.py")) for line in reaches(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_each_kind_of_reach(tmp_path: Path) -> None:
    """The check itself: an import of a private name, a lease's private method, an
    inherited private method and a parent's private method through ``super()``."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from task_locks.context import _current\n"
        "from ._common import LockedTask\n"
        "class T:\n"
        "    def _own(self): return self._own, self._lock_options()\n"
        "    def _run_lock(self): return super()._run_lock()\n"
        "def f(lease): lease._hand_over('x'); return T()._own()\n"
    )
    assert [line.split(": ", 1)[1] for line in reaches(probe)] == [
        "from task_locks.context import _current",
        "self._lock_options",
        "super()._run_lock",
        "lease._hand_over",
    ]
