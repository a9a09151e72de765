"""Whether the import name ``django_app`` is task-locks' Django app (without importing
Django, nor the app).

The app ships as the top-level package ``django_app`` (``INSTALLED_APPS +=
["django_app"]``). A project with a package of its own by that name, earlier on
``sys.path``, hides ours: Django would load the project's package instead, and with it
no admin pages, no ``manage.py locks``, no system checks, and nothing would say so. Our
package carries :data:`MARKER`; :func:`problem` tells an impostor from it (the package's
import warns with it, and ``django_app``'s system check reports it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Final

#: The attribute ``django_app/__init__.py`` sets (to ``True``): this is task-locks' app.
MARKER: Final = "__task_locks_app__"
_OURS: Final = Path(__file__).resolve().parent.parent / "django_app" / "__init__.py"


def problem() -> str | None:
    """``None`` if ``django_app`` is ours (or absent), else what hides it and the fix."""
    module = sys.modules.get("django_app")
    if module is not None:
        if getattr(module, MARKER, False):
            return None
        return _hidden_by(getattr(module, "__file__", None))
    try:
        spec = importlib.util.find_spec("django_app")  # finds it; runs nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not _OURS.exists():
        return None  # not installed beside us: nothing to compare with
    origin = Path(spec.origin).resolve() if spec.origin else None
    return None if origin == _OURS else _hidden_by(spec.origin)


def _hidden_by(where: str | None) -> str:
    found = where or "a namespace package (a django_app/ folder without __init__.py)"
    return (
        f"the import name 'django_app' is not task-locks' Django app: it resolves to "
        f"{found}, a package of your project that hides task-locks' ({_OURS.parent}), so "
        "INSTALLED_APPS's 'django_app' loads yours: no Lock holders/events admin, no "
        "`manage.py locks`, no task-locks checks, no django:// backend. Rename your "
        "django_app package (and its imports); task-locks' app must keep that name"
    )


__all__ = ["MARKER", "problem"]
