"""The ``TASK_LOCKS`` setting: the only place it is read.

::

    TASK_LOCKS = {
        "BACKEND": "redis://127.0.0.1:6379/0",   # any task-locks URL; default django://default
        "DEFAULT_TTL": 30,                        # seconds, > 0
        "KEY_PREFIX": "myproject:",               # namespace (the URL's ?prefix= option)
        "AUDIT": ["lost", "forced", "conflict"],  # event kinds to record; True = all, False = none
        "EVENT_RETENTION_DAYS": 30,               # ``manage.py locks prune`` deletes older events
    }

Values are parsed lazily and re-read when the setting changes (``override_settings`` in
tests, ``setting_changed``). Parsing never raises at import: the system checks
(:mod:`django_app.checks`) report bad values with stable ids, and a misconfigured backend
fails loudly when used instead of silently falling back to another server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

import task_locks
from task_locks import Backend, InvalidArgument, get_backend
from task_locks.types import AcquireResult, Holder, Owner

SETTING = "TASK_LOCKS"
EVENT_KINDS = ("acquired", "released", "lost", "forced", "conflict")
DEFAULTS: dict[str, Any] = {
    "BACKEND": "django://default",
    "DEFAULT_TTL": 30,
    "KEY_PREFIX": "",
    "AUDIT": ("lost", "forced", "conflict"),
    "EVENT_RETENTION_DAYS": 30,
}
#: Schemes whose URL takes a ``prefix`` option (where ``KEY_PREFIX`` goes).
PREFIX_SCHEMES = frozenset(
    {"redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "redlock", "etcd", "django"}
)


@dataclass(frozen=True, slots=True)
class LockSettings:
    backend_url: str
    default_ttl: float
    key_prefix: str
    audit: frozenset[str]
    event_retention_days: float


def raw() -> dict[str, Any]:
    """The user's ``TASK_LOCKS`` dict as given (empty if unset)."""
    value = getattr(settings, SETTING, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"{SETTING} must be a dict, got {type(value).__name__}")
    return dict(value)


def unknown_keys() -> list[str]:
    return sorted(set(raw()) - set(DEFAULTS))


def merged() -> dict[str, Any]:
    """``TASK_LOCKS`` over :data:`DEFAULTS`, values not yet parsed."""
    return {**DEFAULTS, **raw()}


def parse_ttl(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ImproperlyConfigured(f"{SETTING}['DEFAULT_TTL'] must be seconds, got {value!r}")
    if value <= 0:
        raise ImproperlyConfigured(f"{SETTING}['DEFAULT_TTL'] must be > 0 seconds, got {value!r}")
    return float(value)


def parse_audit(value: object) -> frozenset[str]:
    if value is True:
        return frozenset(EVENT_KINDS)
    if value is False or value is None:
        return frozenset()
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ImproperlyConfigured(
            f"{SETTING}['AUDIT'] must be True, False or a list of {list(EVENT_KINDS)}, "
            f"got {value!r}"
        )
    bad = sorted(str(v) for v in value if v not in EVENT_KINDS)
    if bad:
        raise ImproperlyConfigured(
            f"{SETTING}['AUDIT'] has unknown event kinds {bad}; known: {list(EVENT_KINDS)}"
        )
    return frozenset(value)


def parse_retention(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ImproperlyConfigured(
            f"{SETTING}['EVENT_RETENTION_DAYS'] must be a number of days > 0, got {value!r}"
        )
    return float(value)


def with_prefix(url: str, prefix: str) -> str:
    """``url`` with ``KEY_PREFIX`` as its ``prefix`` option, where the scheme takes one."""
    if not prefix:
        return url
    parts = urlsplit(url)
    if parts.scheme.lower() not in PREFIX_SCHEMES:
        return url
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.setdefault("prefix", prefix)
    return urlunsplit(parts._replace(query=urlencode(query)))


def parse_backend_url(value: object, prefix: str = "") -> str:
    if not isinstance(value, str) or "://" not in value:
        raise ImproperlyConfigured(
            f"{SETTING}['BACKEND'] must be a backend URL such as redis://127.0.0.1:6379/0 "
            f"or django://default, got {value!r}"
        )
    return with_prefix(value.strip(), prefix)


def parse_prefix(value: object) -> str:
    if not isinstance(value, str):
        raise ImproperlyConfigured(f"{SETTING}['KEY_PREFIX'] must be a string, got {value!r}")
    return value


_cache: LockSettings | None = None


def lock_settings() -> LockSettings:
    """The parsed settings; raises ``ImproperlyConfigured`` naming the bad key."""
    global _cache
    if _cache is None:
        values = merged()
        prefix = parse_prefix(values["KEY_PREFIX"])
        _cache = LockSettings(
            backend_url=parse_backend_url(values["BACKEND"], prefix),
            default_ttl=parse_ttl(values["DEFAULT_TTL"]),
            key_prefix=prefix,
            audit=parse_audit(values["AUDIT"]),
            event_retention_days=parse_retention(values["EVENT_RETENTION_DAYS"]),
        )
    return _cache


def audit_kinds() -> frozenset[str]:
    try:
        return lock_settings().audit
    except ImproperlyConfigured:
        return frozenset(DEFAULTS["AUDIT"])


class MisconfiguredBackend(Backend):
    """Stands in for the configured backend when ``TASK_LOCKS`` is wrong.

    Every operation raises the configuration error, so a worker that starts with a bad
    setting fails loudly at its first lock instead of locking on some other server.
    """

    def __init__(self, problem: str) -> None:
        super().__init__("misconfigured://")
        self.problem = problem

    def _fail(self, name: str | None = None) -> InvalidArgument:
        return InvalidArgument(f"task-locks is misconfigured: {self.problem}", name=name)

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        raise self._fail(name)

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        raise self._fail(name)

    def release(self, name: str, token: str) -> bool:
        raise self._fail(name)

    def holders(self, prefix: str = "") -> list[Holder]:
        raise self._fail()

    def force_release(self, name: str, fence: int | None = None) -> bool:
        raise self._fail(name)


def backend() -> Backend:
    """The backend ``TASK_LOCKS`` names (a :class:`MisconfiguredBackend` if it is wrong)."""
    try:
        return get_backend(lock_settings().backend_url)
    except (ImproperlyConfigured, InvalidArgument) as exc:
        return MisconfiguredBackend(str(exc))


def default_ttl() -> float:
    try:
        return lock_settings().default_ttl
    except ImproperlyConfigured:
        return float(DEFAULTS["DEFAULT_TTL"])


def apply() -> None:
    """Make the settings the process-wide task-locks defaults (called from ``ready()``)."""
    task_locks.configure(backend=backend(), default_ttl=default_ttl())


@receiver(setting_changed)
def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    global _cache
    if setting == SETTING:
        _cache = None
        apply()


__all__ = [
    "DEFAULTS",
    "EVENT_KINDS",
    "LockSettings",
    "MisconfiguredBackend",
    "apply",
    "audit_kinds",
    "backend",
    "default_ttl",
    "lock_settings",
    "merged",
    "raw",
    "unknown_keys",
]
