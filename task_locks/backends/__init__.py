"""Backend registry: the URL's scheme picks the backend class.

Built-in schemes are listed once, in :data:`BUILTIN_SCHEMES`; everything else that names
schemes (the Django settings' checks, error messages) reads it. Other packages add
schemes through the ``task_locks.backends`` entry-point group
(``scheme = "package.module:Class"``) or by calling :func:`register_backend`. Classes are
imported only when a URL asks for them, so ``etcd3gw`` or Django are needed only by those
who use them.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from urllib.parse import urlsplit

from ..app_identity import problem as django_app_problem
from ..errors import InvalidArgument
from .base import CAPABILITIES, Backend, Capability, redact_url

#: The entry-point group through which other packages add schemes.
ENTRY_POINT_GROUP = "task_locks.backends"
#: Every built-in URL scheme and the class serving it (``"module:Class"``, imported on
#: first use). The one list of them: add a built-in backend here and nowhere else.
BUILTIN_SCHEMES: Mapping[str, str] = MappingProxyType(
    {
        "redis": "task_locks.backends.redis:RedisBackend",
        "rediss": "task_locks.backends.redis:RedisBackend",
        "unix": "task_locks.backends.redis:RedisBackend",
        "redis+sentinel": "task_locks.backends.redis:RedisBackend",
        "redis+cluster": "task_locks.backends.redis:RedisBackend",
        "redlock": "task_locks.backends.redlock:RedlockBackend",
        "etcd": "task_locks.backends.etcd:EtcdBackend",
        "etcds": "task_locks.backends.etcd:EtcdBackend",
        "django": "django_app.backend:DjangoBackend",
        "memory": "task_locks.backends.memory:MemoryBackend",
    }
)
#: Built-in schemes whose URL takes a ``prefix`` option (the namespace before every lock
#: name): all but ``memory://``, whose locks never leave the process.
PREFIX_SCHEMES: frozenset[str] = frozenset(BUILTIN_SCHEMES) - {"memory"}
_registry: dict[str, str | type[Backend]] = dict(BUILTIN_SCHEMES)
_instances: dict[str, Backend] = {}
_lock = threading.Lock()


def register_backend(scheme: str, target: str | type[Backend]) -> None:
    """Serve ``scheme://`` URLs with ``target`` (a class or ``"module:Class"``)."""
    _registry[scheme.lower()] = target


def _add_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(ep.name.lower(), ep.value)


def known_schemes() -> list[str]:
    """Every scheme a URL may use: built-in, registered or from an entry point, sorted."""
    _add_entry_points()
    return sorted(_registry)


def backend_class(scheme: str) -> type[Backend]:
    """The class serving ``scheme://`` URLs, imported now if it was not yet."""
    return _load(scheme.lower())


def _load(scheme: str) -> type[Backend]:
    target = _registry.get(scheme)
    if target is None:
        _add_entry_points()
        target = _registry.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in known_schemes())
        raise InvalidArgument(f"unknown lock backend scheme {scheme + '://'!r}; known: {known}")
    if isinstance(target, str):
        module_name, _, class_name = target.partition(":")
        hidden = module_name.startswith("django_app.") and django_app_problem()
        if hidden:
            raise InvalidArgument(f"the {scheme}:// backend cannot load: {hidden}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise InvalidArgument(
                f"the {scheme}:// backend needs {module_name!r}, which failed to import: {exc}"
                " (install task-locks with the matching extra: from a checkout, the only way "
                "today, pip install -e '.[etcd]' for etcd://)"
            ) from exc
        target = getattr(module, class_name)
        _registry[scheme] = target
    return target


def get_backend(url: str) -> Backend:
    """The backend for ``url``; one shared instance per URL in each process."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument(f"a backend URL must be a non-empty string, got {url!r}")
    url = url.strip()
    backend = _instances.get(url)
    if backend is not None:
        return backend
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise InvalidArgument(f"malformed backend URL {redact_url(url)!r}: {exc}") from exc
    if not scheme or "://" not in url:
        raise InvalidArgument(
            f"malformed backend URL {redact_url(url)!r}: expected scheme://..., "
            "e.g. redis://127.0.0.1:6379/0"
        )
    cls = _load(scheme)
    # Built outside the lock: a backend's construction may itself configure task-locks
    # (django:// sets Django up, whose ready() calls get_backend again).
    backend = cls(url)
    with _lock:
        shared = _instances.setdefault(url, backend)
    if shared is not backend:
        backend.close()
    return shared


def close_all() -> None:
    """Close and forget every cached backend (tests, shutdown)."""
    with _lock:
        backends = list(_instances.values())
        _instances.clear()
    for backend in backends:
        backend.close()


__all__ = [
    "BUILTIN_SCHEMES",
    "CAPABILITIES",
    "ENTRY_POINT_GROUP",
    "PREFIX_SCHEMES",
    "Backend",
    "Capability",
    "backend_class",
    "close_all",
    "get_backend",
    "known_schemes",
    "register_backend",
]
