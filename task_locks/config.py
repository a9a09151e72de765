"""Process-wide defaults: which backend a :class:`~task_locks.Lock` uses when none is given.

Without Django, call :func:`configure` once at start-up (or set ``TASK_LOCKS_URL``). With
Django, the app's ``ready()`` calls :func:`configure` from the ``TASK_LOCKS`` setting.
There is no silent default server: two hosts that each forgot the setting would each
lock on their own local Redis, with no exclusion between them and nothing saying so. A
lock used with no backend configured raises :class:`~task_locks.errors.NotConfigured`.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

from .backends import get_backend
from .backends.base import MAX_TTL, Backend
from .errors import InvalidArgument, NotConfigured

DEFAULT_TTL = 30.0
#: How to configure a backend, for the error raised when none is.
HOW_TO_CONFIGURE = (
    "no lock backend is configured (task-locks has no default server): pass backend=URL, "
    "call task_locks.configure(backend=URL) at start-up, set the TASK_LOCKS_URL "
    "environment variable, or, with Django, set TASK_LOCKS['BACKEND'] "
    "(the task_locks Django app's default is django://default)"
)


@dataclass(slots=True)
class Settings:
    backend: str | Backend | None = None
    default_ttl: float = DEFAULT_TTL


_settings = Settings()
_guard = threading.Lock()


def validate_ttl(ttl: object, what: str = "ttl", *, name: str | None = None) -> float:
    """``ttl`` as seconds, or an :class:`InvalidArgument` that says what was wrong."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {ttl!r}", name=name)
    if not math.isfinite(ttl) or ttl <= 0:
        raise InvalidArgument(
            f"{what} must be a finite number of seconds > 0, got {ttl!r}", name=name
        )
    if ttl < 0.01:
        raise InvalidArgument(f"{what} must be at least 0.01 seconds, got {ttl!r}", name=name)
    if ttl > MAX_TTL:
        raise InvalidArgument(
            f"{what} must be at most {MAX_TTL:,.0f} seconds (1 year), got {ttl!r}", name=name
        )
    return float(ttl)


def configure(*, backend: str | Backend | None = None, default_ttl: float | None = None) -> None:
    """Set the process-wide default backend (URL or instance) and default TTL (seconds)."""
    with _guard:
        if backend is not None:
            if isinstance(backend, str):
                get_backend(backend)  # fail now, at configuration time, on a bad URL
            elif not isinstance(backend, Backend):
                raise InvalidArgument(f"backend must be a URL or a Backend, got {backend!r}")
            _settings.backend = backend
        if default_ttl is not None:
            _settings.default_ttl = validate_ttl(default_ttl, "default_ttl")


def reset() -> None:
    """Forget :func:`configure` calls (tests)."""
    with _guard:
        _settings.backend = None
        _settings.default_ttl = DEFAULT_TTL


def default_ttl() -> float:
    return _settings.default_ttl


def resolve_backend(backend: str | Backend | None = None, *, name: str | None = None) -> Backend:
    """The backend to use: the one given, else the configured one, else ``TASK_LOCKS_URL``.

    With none of them, :class:`NotConfigured` (about lock ``name``), saying how to set one.
    """
    if backend is None:
        backend = _settings.backend or os.environ.get("TASK_LOCKS_URL", "").strip() or None
    if backend is None:
        raise NotConfigured(
            f"lock {name!r}: {HOW_TO_CONFIGURE}" if name else HOW_TO_CONFIGURE, name=name
        )
    if isinstance(backend, Backend):
        return backend
    return get_backend(backend)
