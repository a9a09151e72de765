"""The ``TASK_LOCKS`` setting: the only place it is read.

::

    TASK_LOCKS = {
        "BACKEND": "redis://127.0.0.1:6379/0",   # any task-locks URL; default: $TASK_LOCKS_URL
                                                  # when set, else django://default
        "DEFAULT_TTL": 30,                        # seconds, > 0
        "KEY_PREFIX": "myproject:",               # namespace (the URL's ?prefix= option)
        "AUDIT": ["lost", "forced", "conflict"],  # event kinds to record; True = all, False = none
        "EVENT_RETENTION_DAYS": 30,               # ``manage.py locks prune`` deletes older events
        "METRICS": False,                         # True: task_locks.metrics.install() at start-up
    }

**One lock name, one lock.** The namespace's one source of truth is the backend URL (its
``prefix`` option; ``KEY_PREFIX`` is folded into it). The ``task-locks`` CLI cannot read
these settings: it locks where ``TASK_LOCKS_URL`` says. So when ``TASK_LOCKS_URL`` is set,
it is also ``BACKEND``'s default, and a ``TASK_LOCKS`` that would lock on another server or
in another namespace is refused (system check ``task_locks.E005``, and :func:`backend`
fails at first use) instead of taking other locks than the CLI for the same names.

Values are parsed lazily and re-read when the setting changes (``override_settings`` in
tests, ``setting_changed``). Parsing never raises at import: the system checks
(:mod:`django_app.checks`) report bad values with stable ids, and a misconfigured backend
fails loudly when used instead of silently falling back to another server.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

import task_locks
from task_locks import Backend, InvalidArgument, LockError, get_backend
from task_locks.backends import PREFIX_SCHEMES  # where KEY_PREFIX can go: the registry's
from task_locks.backends.base import redact_url
from task_locks.listing import backend_namespace
from task_locks.types import AcquireResult, Holder, Owner

SETTING = "TASK_LOCKS"
#: The lock event kinds (:data:`task_locks.events.EVENT_KINDS`) an audit row can keep:
#: all but ``renewed`` (one per renewal: a metric, not history).
EVENT_KINDS = (
    "acquired",
    "released",
    "lost",
    "forced",
    "conflict",
    "renewal_failed",
    "renewal_late",
    "duplicate",
    "error",
)
DEFAULTS: dict[str, Any] = {
    "BACKEND": "django://default",
    "DEFAULT_TTL": 30,
    "KEY_PREFIX": "",
    "AUDIT": ("lost", "forced", "conflict"),
    "EVENT_RETENTION_DAYS": 30,
    "METRICS": False,
}
#: The environment variable the ``task-locks`` CLI reads: ``BACKEND``'s default when set.
ENV_URL = "TASK_LOCKS_URL"
#: URL options that tune how a backend talks to its server, not where locks live: two URLs
#: that differ only in these name the same locks.
TUNING_OPTIONS = frozenset(
    {
        "socket_timeout",
        "connect_timeout",
        "wait_replicas",
        "wait_timeout",
        "fence_ttl",
        "node_timeout",
        "retry_delay",
        "drift_factor",
        "restart_delay",
        "fence_sync",
        "timeout",
    }
)


@dataclass(frozen=True, slots=True)
class LockSettings:
    backend_url: str
    default_ttl: float
    key_prefix: str
    audit: frozenset[str]
    event_retention_days: float
    metrics: bool


def raw() -> dict[str, Any]:
    """The user's ``TASK_LOCKS`` dict as given (empty if unset)."""
    value = getattr(settings, SETTING, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"{SETTING} must be a dict, got {type(value).__name__}")
    return dict(value)


def unknown_keys() -> list[str]:
    """The keys of ``TASK_LOCKS`` this version does not know (typos), sorted."""
    return sorted(set(raw()) - set(DEFAULTS))


def env_url() -> str:
    """``$TASK_LOCKS_URL`` (stripped), ``""`` when unset."""
    return os.environ.get(ENV_URL, "").strip()


def merged() -> dict[str, Any]:
    """``TASK_LOCKS`` over :data:`DEFAULTS`, values not yet parsed.

    ``BACKEND`` defaults to ``$TASK_LOCKS_URL`` when that is set, so one variable
    configures the app and the ``task-locks`` CLI alike.
    """
    given = raw()
    values = {**DEFAULTS, **given}
    if "BACKEND" not in given and env_url():
        values["BACKEND"] = env_url()
    return values


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
    """``EVENT_RETENTION_DAYS``: a finite number of days > 0 (NaN or infinity would make
    every prune fail: no date is that many days ago)."""
    days = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if days is None or not math.isfinite(days) or days <= 0:
        raise ImproperlyConfigured(
            f"{SETTING}['EVENT_RETENTION_DAYS'] must be a number of days > 0, got {value!r}"
        )
    return float(days)


def with_prefix(url: str, prefix: str) -> str:
    """``url`` with ``KEY_PREFIX`` as its ``prefix`` option, where the scheme takes one.

    A URL that already names another prefix is refused: which one would win is exactly
    the kind of doubt that puts one name in two namespaces.
    """
    if not prefix:
        return url
    parts = urlsplit(url)
    if parts.scheme.lower() not in PREFIX_SCHEMES:
        return url
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if query.get("prefix", prefix) != prefix:
        raise ImproperlyConfigured(
            f"{SETTING}['KEY_PREFIX'] is {prefix!r} but the backend URL "
            f"{redact_url(url)} has prefix={query['prefix']!r}: name the namespace once, "
            "in the URL's prefix option"
        )
    query["prefix"] = prefix
    return urlunsplit(parts._replace(query=urlencode(query)))


def lock_space(url: str) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    """Where ``url``'s locks live: scheme, server, path and the options that pick them.

    No credentials, no :data:`TUNING_OPTIONS` and no ``prefix`` (compared separately,
    with the backend's default filled in).
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    where = sorted((k, v) for k, v in query if k != "prefix" and k not in TUNING_OPTIONS)
    return (
        parts.scheme.lower(),
        parts.netloc.rpartition("@")[2].lower(),
        parts.path.rstrip("/"),
        tuple(where),
    )


def _namespace(url: str) -> str | None:
    return backend_namespace(get_backend(url))


#: How to make the Django app and ``TASK_LOCKS_URL`` agree (E005's hint).
NAMESPACE_HINT = (
    f"Set the namespace in one place, the URL: e.g. {ENV_URL}="
    "'redis://127.0.0.1:6379/0?prefix=myproject:', and drop BACKEND and KEY_PREFIX from "
    f"{SETTING} (BACKEND then defaults to ${ENV_URL}); or give BACKEND the very URL "
    f"of ${ENV_URL}."
)


def namespace_problem(url: str) -> str | None:
    """Why the app's backend ``url`` would take other locks than ``$TASK_LOCKS_URL``.

    ``None`` when the variable is unset or names the same server and namespace.
    """
    env = env_url()
    if not env or env == url:
        return None
    try:
        theirs = _namespace(env)
    except (LockError, ValueError) as exc:
        return f"${ENV_URL} ({redact_url(env)}) is not a usable backend URL: {exc}"
    ours = _namespace(url)  # a bad url raises InvalidArgument, as get_backend(url) would
    if lock_space(env) == lock_space(url) and theirs == ours:
        return None
    return (
        f"{SETTING} locks on {redact_url(url)} (namespace {ours!r}) but ${ENV_URL}, which "
        f"the task-locks CLI uses, is {redact_url(env)} (namespace {theirs!r}): the same "
        "lock name would be two different locks. " + NAMESPACE_HINT
    )


def parse_metrics(value: object) -> bool:
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{SETTING}['METRICS'] must be True or False, got {value!r}")
    return value


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
_cached_env: str = ""


def lock_settings() -> LockSettings:
    """The parsed settings; raises ``ImproperlyConfigured`` naming the bad key."""
    global _cache, _cached_env
    if _cache is None or _cached_env != env_url():  # BACKEND's default is the variable
        _cached_env = env_url()
        values = merged()
        prefix = parse_prefix(values["KEY_PREFIX"])
        _cache = LockSettings(
            backend_url=parse_backend_url(values["BACKEND"], prefix),
            default_ttl=parse_ttl(values["DEFAULT_TTL"]),
            key_prefix=prefix,
            audit=parse_audit(values["AUDIT"]),
            event_retention_days=parse_retention(values["EVENT_RETENTION_DAYS"]),
            metrics=parse_metrics(values["METRICS"]),
        )
    return _cache


def audit_kinds() -> frozenset[str]:
    """The event kinds ``AUDIT`` keeps (the defaults while the setting is invalid: checks report
    it)."""
    try:
        return lock_settings().audit
    except ImproperlyConfigured:
        return frozenset(DEFAULTS["AUDIT"])


def metrics_enabled() -> bool:
    """``METRICS``: install the Prometheus collectors at start-up (a bad value: no)."""
    try:
        return lock_settings().metrics
    except ImproperlyConfigured:
        return False


class MisconfiguredBackend(Backend):
    """Stands in for the configured backend when ``TASK_LOCKS`` is wrong.

    Every operation raises the configuration error, so a worker that starts with a bad
    setting fails loudly at its first lock instead of locking on some other server.
    """

    def __init__(self, problem: str) -> None:
        super().__init__("misconfigured://")
        self.problem = problem

    def _fail(self, name: str | None = None) -> InvalidArgument:
        return InvalidArgument(f"the lock settings are misconfigured: {self.problem}", name=name)

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
    """The backend ``TASK_LOCKS`` names (a :class:`MisconfiguredBackend` if it is wrong,
    or if it would lock elsewhere than ``$TASK_LOCKS_URL``: see :func:`namespace_problem`).
    """
    try:
        url = lock_settings().backend_url
        chosen = get_backend(url)
        problem = namespace_problem(url)
        if problem is not None:
            return MisconfiguredBackend(problem)
        return chosen
    except ImproperlyConfigured as exc:  # names the key already
        return MisconfiguredBackend(str(exc))
    except InvalidArgument as exc:  # get_backend's words: say which setting gave the URL
        return MisconfiguredBackend(f"{_backend_source()}: {exc}")


def _backend_source() -> str:
    """Where the backend URL came from, as an operator would go and fix it."""
    if "BACKEND" not in raw() and env_url():
        return f"${ENV_URL} (the default of settings.{SETTING}['BACKEND'])"
    return f"settings.{SETTING}['BACKEND']"


def default_ttl() -> float:
    """``DEFAULT_TTL`` in seconds (the default while the setting is invalid: checks report it)."""
    try:
        return lock_settings().default_ttl
    except ImproperlyConfigured:
        return float(DEFAULTS["DEFAULT_TTL"])


def debug() -> bool:
    """``settings.DEBUG``: a development site, where a one-machine lock backend is fine."""
    return bool(getattr(settings, "DEBUG", False))


def database_vendor(alias: str) -> str | None:
    """The vendor (``sqlite``, ``postgresql``...) of ``DATABASES[alias]``, if it exists."""
    from django.db import connections

    return connections[alias].vendor if alias in connections.settings else None


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
    "ENV_URL",
    "EVENT_KINDS",
    "LockSettings",
    "MisconfiguredBackend",
    "apply",
    "audit_kinds",
    "backend",
    "database_vendor",
    "debug",
    "default_ttl",
    "env_url",
    "lock_settings",
    "lock_space",
    "merged",
    "metrics_enabled",
    "namespace_problem",
    "raw",
    "unknown_keys",
]
