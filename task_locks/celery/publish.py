"""Enqueue-time de-duplication for ``lock_on="enqueue"`` / ``"both"``.

Every Celery publish ends in ``app.amqp.send_task_message(producer, name, message, ...)``:
``delay``, ``apply_async``, ``app.send_task`` by name, canvas (chains, groups, chords)
and beat alike. Celery's ``before_task_publish`` signal fires in there too, but a signal
cannot stop a publish (Celery logs and swallows a receiver's exception), so the guard
wraps that one function on the app's ``amqp`` object instead:

- it takes the key's lock (no renewal; owner = the new task id) and puts the lock's
  token and fence in the message headers. The lock lasts ``enqueue_ttl`` from the
  message's ETA if the task sets it; else until the message's ``expires`` (after which
  no worker runs it), else :data:`DEFAULT_ENQUEUE_TTL` (an hour, like celery-once: a
  queue that is slower than the lock lets duplicates in, so the default is long; a
  lost message keeps the key that long). A past ETA means "run now", as in Celery.
  A worker that runs a message whose queued lock already expired logs it at WARNING. The worker that runs the message frees that lock, token-checked,
  when the task starts (``"enqueue"``), or (``"both"``) takes it over as the run lock
  by acquiring under the same token: one server-side step that keeps the fence and
  resets TTL and owner, so the key is never free between the two.
  A message that is never consumed frees the key after the TTL; a revoked or expired
  one frees it when a worker drops it (``task_revoked``). A publish whose acquire got no
  answer sends nothing, and frees the key its acquire may have taken (token-checked, in
  the background, tried again until the TTL: :meth:`~.releaser.Releaser.free_later`).
- if the key is taken, nothing is published: ``DuplicateTask`` (a ``LockHeld``) is
  raised with the holder's ``AsyncResult`` as ``existing``. ``delay``/``apply_async``
  (hence canvas and beat, for tasks the publisher has registered) return that handle
  instead, for ``on_conflict`` ``"skip"`` and ``"retry"``; ``"raise"`` raises;
  ``"wait"`` first waits up to ``wait_timeout`` for the key. ``app.send_task`` by name
  always raises ``DuplicateTask``, as its return value cannot name another task.
- retries (``self.retry()``, ``retry_on_worker_lost``) are not de-duplicated: they
  re-run a message that already passed. With ``"both"``, a task retrying itself hands
  its running lease to the retry message (kept, unrenewed, for the countdown plus
  ``enqueue_ttl``), so no duplicate can be queued during the countdown; other retries
  meet the run-time lock when they run.

Only tasks registered in the publishing process can be guarded (the key comes from the
task's code); ``send_task`` of a name this process does not know is published as is.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast

from .. import events
from .._friends import acquire_fresh
from ..errors import BackendUnavailable, LockError, LockHeld
from ..lock import Lock
from ..owner import owner_context
from ._common import (
    FENCE_HEADER,
    TOKEN_HEADER,
    DuplicateTask,
    LockedTask,
    hand_over_to_retry,
    message_arguments,
    park_for_retry,
)
from .options import for_this_publish
from .releaser import releaser

if TYPE_CHECKING:
    from .task import SingletonTask

log = logging.getLogger("task_locks.celery")

Sender = Callable[..., Any]

#: Seconds a publish-time lock lasts when neither ``enqueue_ttl`` nor ``expires`` says.
DEFAULT_ENQUEUE_TTL: Final = 3600.0
#: Seconds a lock that lasts until the message's ``expires`` is kept past it (clock skew).
EXPIRES_MARGIN: Final = 1.0


class _GuardedSender:
    """Stands in for ``app.amqp.send_task_message``; resolves Celery's sender lazily.

    Celery builds its sender from the configuration at the first publish; so does this
    guard (installed when a task is bound, possibly before the app is configured).
    """

    def __init__(self, app: Any, send: Sender | None) -> None:
        self.app = app
        self._send = send
        self._guard = threading.Lock()

    def _sender(self) -> Sender:
        send = self._send
        if send is None:
            with self._guard:
                if self._send is None:
                    amqp = self.app.amqp
                    del amqp.send_task_message  # drop this guard from the cache...
                    self._send = amqp.send_task_message  # ...so Celery builds its own,
                    amqp.send_task_message = self  # then stand in front of it again
                send = self._send
        assert send is not None
        return send

    def __call__(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        send = self._sender()
        task = self.app._tasks.get(name)  # as send_task does: never finalizes the app
        if not isinstance(task, LockedTask):
            return send(producer, name, message, **options)
        singleton = cast("SingletonTask", task)
        if singleton.lock_on == "run":
            return send(producer, name, message, **options)
        return guarded_publish(singleton, send, producer, name, message, options)


def install_publish_guard(app: Any) -> None:
    """Route ``app``'s publishes through the guard (idempotent)."""
    amqp = app.amqp
    current = amqp.__dict__.get("send_task_message")
    if isinstance(current, _GuardedSender):
        return
    amqp.send_task_message = _GuardedSender(app, current)


def guarded_publish(
    task: SingletonTask,
    send: Sender,
    producer: Any,
    name: str,
    message: Any,
    options: dict[str, Any],
) -> Any:
    headers, _properties, body, _event = message
    task = for_this_publish(task, headers, options)  # lock_options={"enqueue_ttl": ...}
    args, kwargs = message_arguments(body)
    task_id = headers.get("id") if "id" in headers else body.get("id")
    retries = headers.get("retries") or (body.get("retries") if isinstance(body, dict) else 0)
    if retries:
        return _publish_retry(task, send, producer, name, message, options, task_id, args, kwargs)
    key = task.lock_name(*args, **kwargs)
    if releaser.pending(key):  # a run of this key here just ended: let its release land
        releaser.flush_key(key)
    ttl = _enqueue_ttl(task, headers)
    token = secrets.token_hex(16)  # known here should the acquire's reply be lost
    lock = acquire_fresh(Lock(key, ttl=ttl, backend=task.lock_backend, renew=False), token)
    timeout = task.wait_timeout if task.on_conflict == "wait" else 0
    with owner_context(task_id=task_id, task_name=task.name, worker=None, command=None):
        try:
            with events.context(policy="", detail=f"publish {task.name}"):  # one `duplicate`
                lease = lock.acquire(timeout=timeout)
        except BackendUnavailable:
            # The acquire may have taken the key with nothing published (also where the
            # last try could not connect: an earlier one may have got through): free it,
            # token-checked, in the background, or it would hold until the TTL.
            releaser.free_later(lock.backend, key, token, ttl)
            raise
        except LockHeld as held:
            events.emit(
                events.Duplicate(
                    name=key,
                    backend=getattr(lock.backend, "server", ""),
                    owner=held.holder.owner if held.holder is not None else None,
                    detail=f"not queued: {task.name}[{task_id}]",
                )
            )
            holder_id = held.holder.owner.task_id if held.holder is not None else None
            existing = task.AsyncResult(holder_id) if holder_id else None
            log.info("not queueing %s[%s]: %s", task.name, task_id, held)
            raise DuplicateTask(
                f"not queued: {held}", name=key, holder=held.holder, existing=existing
            ) from None
    _stamp(headers, options, lease.token, lease.fence)
    try:
        sent = send(producer, name, message, **options)
    except BaseException:
        try:
            lease.release()
        except LockError as exc:
            log.warning("releasing lock %r after a failed publish: %s", key, exc)
        raise
    lease.hand_over(f"the worker of {task.name}[{task_id}]")  # no longer held here
    return sent


def _publish_retry(
    task: SingletonTask,
    send: Sender,
    producer: Any,
    name: str,
    message: Any,
    options: dict[str, Any],
    task_id: str,
    args: Any,
    kwargs: Any,
) -> Any:
    """A retry is never de-duplicated; with ``"both"`` it inherits the running lease."""
    lease = hand_over_to_retry(task, task_id, args, kwargs)
    if lease is None:
        return send(producer, name, message, **options)
    headers = message[0]
    _stamp(headers, options, lease.token, lease.fence)
    result = send(producer, name, message, **options)
    park_for_retry(lease, _countdown(headers.get("eta")), task.enqueue_ttl or lease.ttl)
    return result


def _stamp(headers: Any, options: dict[str, Any], token: str, fence: int) -> None:
    """Put the queued lock's token and fence in the message headers.

    Celery merges ``options["headers"]`` over the message headers: set them in both.
    """
    stamp = {TOKEN_HEADER: token, FENCE_HEADER: fence}
    headers.update(stamp)
    options["headers"] = {**(options.get("headers") or {}), **stamp}


def _enqueue_ttl(task: SingletonTask, headers: Any) -> float:
    """Seconds the publish-time lock lasts (see the module doc)."""
    due = _countdown(headers.get("eta"))
    if task.enqueue_ttl is not None:
        return due + task.enqueue_ttl
    expires = _seconds_until(headers.get("expires"))
    if expires is not None:
        return max(expires, due) + EXPIRES_MARGIN
    return due + DEFAULT_ENQUEUE_TTL


def _seconds_until(moment: Any) -> float | None:
    """Seconds until an ``eta``/``expires`` header (ISO 8601; negative if past), or None."""
    if not moment:
        return None
    try:
        when = dt.datetime.fromisoformat(str(moment))
    except ValueError:
        return None
    now = dt.datetime.now(when.tzinfo) if when.tzinfo else dt.datetime.now()
    return (when - now).total_seconds()


def _countdown(eta: Any) -> float:
    """Seconds until a message's ``eta`` header, 0 if none or past: a past ETA means now."""
    return max(0.0, _seconds_until(eta) or 0.0)


__all__ = ["DEFAULT_ENQUEUE_TTL", "guarded_publish", "install_publish_guard"]
