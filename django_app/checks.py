"""System checks for ``TASK_LOCKS`` (``manage.py check``), with stable ids.

=================  =====================================================================
``task_locks.E001``  ``BACKEND`` is not a usable backend URL (bad scheme, bad options,
                     unknown database alias...)
``task_locks.E002``  ``DEFAULT_TTL`` is not a number of seconds > 0
``task_locks.E003``  ``TASK_LOCKS`` has keys this version does not know (typos)
``task_locks.E004``  ``TASK_LOCKS`` is not a dict, or ``AUDIT`` / ``KEY_PREFIX`` /
                     ``EVENT_RETENTION_DAYS`` / ``METRICS`` has a bad value (or
                     ``METRICS`` is on without prometheus_client installed)
``task_locks.E005``  ``TASK_LOCKS_URL`` is set (the ``task-locks`` CLI locks there) but
                     ``TASK_LOCKS`` locks on another server or in another namespace:
                     one lock name would be two locks
``task_locks.E006``  the backend answered but refuses the URL: a password required or
                     wrong, TLS where the server has none (or the reverse), not a Redis
                     server (what the CLIs exit 78 for)
``task_locks.W001``  the backend did not answer (it may be down or unreachable)
``task_locks.W002``  ``KEY_PREFIX`` is set but the backend does not use it
``task_locks.W003``  outside ``DEBUG``, the locks live in SQLite (``django://`` on a SQLite
                     database, the default when nothing names a backend): they exclude
                     only the processes of one machine
``task_locks.W004``  outside ``DEBUG``, the backend is ``memory://``: locks exclude only
                     the threads of one process
``task_locks.E007``  the import name ``django_app`` is not task-locks' app (a package of
                     the project by that name hides it); also warned at ``import
                     task_locks`` in a Django project, when this check cannot run at all
=================  =====================================================================
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from task_locks import Backend, BackendMisconfigured, LockError, get_backend
from task_locks.app_identity import problem as django_app_problem

from . import conf

_probe_skipped: ContextVar[bool] = ContextVar("task_locks_probe_skipped", default=False)


@contextmanager
def without_backend_probe() -> Iterator[None]:
    """Skip W001 (a ``LockedCommand`` reports an unreachable backend itself, in one line,
    and should not wait up to ``PROBE_TIMEOUT`` before it tries)."""
    token = _probe_skipped.set(True)
    try:
        yield
    finally:
        _probe_skipped.reset(token)


#: How long W001 waits for the backend to answer.
PROBE_TIMEOUT = 3.0
_PROBE_NAME = "task-locks:system-check"


def _error(id_: str, msg: str, hint: str | None = None) -> checks.CheckMessage:
    return checks.Error(msg, hint=hint, id=f"task_locks.{id_}", obj=conf.SETTING)


def _warning(id_: str, msg: str, hint: str | None = None) -> checks.CheckMessage:
    return checks.Warning(msg, hint=hint, id=f"task_locks.{id_}", obj=conf.SETTING)


def _probe(backend: Backend) -> checks.CheckMessage | None:
    """``None`` if the backend answered within ``PROBE_TIMEOUT`` and took the URL, else
    E006 (it answered and refused the URL) or W001 (no usable answer)."""
    outcome: list[Exception | None] = []

    def run() -> None:
        try:
            backend.holder(_PROBE_NAME)
            outcome.append(None)
        except Exception as exc:  # a check must report, never crash
            outcome.append(exc)

    thread = threading.Thread(target=run, name="task-locks-check", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT)
    if outcome and outcome[0] is None:
        return None
    if outcome and isinstance(outcome[0], BackendMisconfigured):
        return _error(
            "E006",
            f"the lock backend {backend.server} answered but refuses the URL: {outcome[0]}",
            hint="Fix the URL in TASK_LOCKS['BACKEND'] (or $TASK_LOCKS_URL): locks fail "
            "until it matches the server.",
        )
    if not outcome:
        problem = f"no answer within {PROBE_TIMEOUT:g}s"
    elif isinstance(outcome[0], LockError):
        problem = str(outcome[0])
    else:
        problem = f"{type(outcome[0]).__name__}: {outcome[0]}"
    return _warning(
        "W001",
        f"the lock backend {backend.server} did not answer: {problem}",
        hint="Locks will fail with BackendUnavailable until it is reachable.",
    )


def _one_machine(scheme: str, backend: Backend) -> list[checks.CheckMessage]:
    """W003/W004: a backend that cannot exclude other machines, outside DEBUG."""
    if conf.debug():
        return []
    if scheme == "memory":
        return [
            _warning(
                "W004",
                f"locks on {backend.server} exclude only the threads of this one process: "
                "another worker, web process or host takes the same lock at the same time",
                hint="Set TASK_LOCKS['BACKEND'] (or $TASK_LOCKS_URL) to a shared server, "
                "e.g. redis://host:6379/0; memory:// is for tests and DEBUG.",
            )
        ]
    alias = getattr(backend, "alias", None)
    if scheme == "django" and alias is not None and conf.database_vendor(alias) == "sqlite":
        default = "BACKEND" not in conf.raw() and not conf.env_url()
        given = " (the default: no BACKEND nor $TASK_LOCKS_URL names one)" if default else ""
        return [
            _warning(
                "W003",
                f"locks on {backend.server}{given} live in a SQLite file: they exclude only "
                "processes of this one machine, and other hosts lock on their own copy",
                hint="Set TASK_LOCKS['BACKEND'] (or $TASK_LOCKS_URL) to a server all hosts "
                "share: redis://..., etcd://..., or django://ALIAS on PostgreSQL/MySQL.",
            )
        ]
    return []


@checks.register("task_locks")
def check_app_import_name(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E007: ``django_app`` resolves to task-locks' app (the marker it carries)."""
    hidden = django_app_problem()
    return [] if hidden is None else [_error("E007", hidden)]


@checks.register("task_locks")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The system check of ``TASK_LOCKS`` (registered by the app): each problem with its stable id."""
    try:
        merged = conf.merged()
    except ImproperlyConfigured as exc:  # TASK_LOCKS is not a dict
        return [_error("E004", str(exc))]
    messages: list[checks.CheckMessage] = []

    unknown = conf.unknown_keys()
    if unknown:
        messages.append(
            _error(
                "E003",
                f"{conf.SETTING} has unknown keys: {', '.join(unknown)}",
                hint=f"Known keys: {', '.join(sorted(conf.DEFAULTS))}.",
            )
        )
    try:
        conf.parse_ttl(merged["DEFAULT_TTL"])
    except ImproperlyConfigured as exc:
        messages.append(_error("E002", str(exc), hint="Use a number of seconds, e.g. 30."))
    prefix = ""
    for key, parse in [
        ("KEY_PREFIX", conf.parse_prefix),
        ("AUDIT", conf.parse_audit),
        ("EVENT_RETENTION_DAYS", conf.parse_retention),
        ("METRICS", conf.parse_metrics),
    ]:
        try:
            value = parse(merged[key])
        except ImproperlyConfigured as exc:
            messages.append(_error("E004", str(exc)))
        else:
            if key == "KEY_PREFIX":
                prefix = str(value)
            if key == "METRICS" and value and importlib.util.find_spec("prometheus_client") is None:
                messages.append(
                    _error(
                        "E004",
                        f"{conf.SETTING}['METRICS'] is True but prometheus_client is not installed",
                        hint="Install task-locks with its metrics extra (from a checkout, the only "
                        "way today: pip install -e '.[metrics]'), or set METRICS to False.",
                    )
                )

    try:
        url = conf.parse_backend_url(merged["BACKEND"], prefix)
        backend = get_backend(url)
    except (ImproperlyConfigured, LockError) as exc:
        messages.append(
            _error(
                "E001",
                f"{conf.SETTING}['BACKEND'] is not usable: {exc}",
                hint="e.g. redis://127.0.0.1:6379/0, etcd://127.0.0.1:2379 or django://default",
            )
        )
        return messages

    problem = conf.namespace_problem(url)
    if problem is not None:
        messages.append(
            _error(
                "E005", problem.removesuffix(conf.NAMESPACE_HINT).strip(), hint=conf.NAMESPACE_HINT
            )
        )
    scheme = urlsplit(url).scheme.lower()
    if prefix and scheme not in conf.PREFIX_SCHEMES:
        messages.append(
            _warning(
                "W002",
                f"{conf.SETTING}['KEY_PREFIX'] is ignored by the {scheme}:// backend",
                hint="Remove KEY_PREFIX, or use a Redis backend URL.",
            )
        )
    messages += _one_machine(scheme, backend)
    # The database backend's health is Django's own database checks' business (and its
    # table does not exist before the first migrate, when this check also runs).
    if scheme != "django" and not _probe_skipped.get():
        probed = _probe(backend)
        if probed is not None:
            messages.append(probed)
    return messages


__all__ = ["check_settings", "without_backend_probe"]
