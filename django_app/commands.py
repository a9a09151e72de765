"""Management commands that run under a distributed lock.

::

    class Command(LockedCommand):              # manage.py nightly_report
        lock_name = "nightly-report"           # or a template over the options: "report:{account}"
        lock_ttl = 60                          # renewed while handle() runs

        def handle(self, *args, **options): ...

or, on any ``BaseCommand``::

    class Command(BaseCommand):
        @locked_command("report:{account}", ttl=60)
        def handle(self, *args, **options): ...

Every such command gets ``--lock-wait SECONDS`` (default 0: do not wait), ``--lock-ttl
SECONDS`` and ``--no-lock`` (runs unprotected, with a warning). When another process
holds the lock the command prints one line on stderr naming the lock, the holder (host,
pid, command or task) and how long it has held it, and exits with status 75
(``EX_TEMPFAIL``), so cron wrappers can tell "busy" from "failed"; an unreachable
backend is one line and status 69 (``EX_UNAVAILABLE``), a backend refusing the URL
(password, TLS) one line and 78 (``EX_CONFIG``). SIGTERM and Ctrl-C
release the lock before the process exits.

A command whose lock is lost while ``handle()`` runs (renewals did not get through by
the lease's local deadline, or the lock was taken away) is stopped then: a line on
stderr names the lock and why, ``handle()`` is interrupted in the main thread (by a
SIGTERM to that thread, which the command turns into an exception), and the command
fails with a ``CommandError`` and exit status 79 (``EX_LEASE_LOST``; 75 means only "held
elsewhere"). A ``handle()`` running outside the
main thread cannot be interrupted: it fails the same way when it returns.
"""

from __future__ import annotations

import argparse
import functools
import signal
import string
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from task_locks import (
    BackendMisconfigured,
    BackendUnavailable,
    InvalidArgument,
    Lease,
    Lock,
    LockHeld,
    LockLost,
    events,
    owner_context,
)
from task_locks.config import validate_ttl
from task_locks.verbs import (
    EX_CONFIG,
    EX_LEASE_LOST,
    EX_TEMPFAIL,
    EX_UNAVAILABLE,
    conflict_holder,
    conflict_message,
    positive_seconds,
    seconds,
)

from . import audit, checks, conf


class CommandLockHeld(LockHeld):
    """Raised out of ``call_command`` when the lock is held; the CLI exits 75 instead."""

    exit_status = EX_TEMPFAIL


def _validate_template(template: object, where: str) -> str:
    if not isinstance(template, str) or not template.strip():
        raise ImproperlyConfigured(
            f"{where}: lock name must be a non-empty string, got {template!r}"
        )
    try:
        list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ImproperlyConfigured(f"{where}: bad lock name template {template!r}: {exc}") from exc
    return template


def _validate_ttl(ttl: object, where: str) -> float | None:
    if ttl is None:
        return None
    try:
        return validate_ttl(ttl, "lock_ttl")
    except InvalidArgument as exc:
        raise ImproperlyConfigured(f"{where}: {exc}") from exc


def render_lock_name(template: str, options: Mapping[str, Any], command: str) -> str:
    """``template`` filled from the command's options (``{account}``) and ``{command}``."""
    try:
        return template.format(**{"command": command, **options})
    except (KeyError, IndexError) as exc:
        raise CommandError(
            f"lock name {template!r} uses {exc}, which is not an option of {command!r} "
            f"(options: {', '.join(sorted(options))})"
        ) from None


def add_lock_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--lock-wait``, ``--lock-ttl`` and ``--no-lock`` to a command's parser (what
    :class:`LockedCommand` does)."""
    group = parser.add_argument_group("distributed lock")
    # Bad values exit 2 with the command's usage, as every other bad argument does.
    group.add_argument(
        "--lock-wait",
        type=seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the lock if another run holds it (default: 0)",
    )
    group.add_argument(
        "--lock-ttl",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="lock TTL (renewed while the command runs; a crashed run frees it after this)",
    )
    group.add_argument(
        "--no-lock",
        action="store_true",
        help="run WITHOUT the lock (a warning is printed; concurrent runs are possible)",
    )


class _Terminated(BaseException):
    """SIGTERM turned into an exception, so ``finally`` blocks (the release) run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_locked(
    command: BaseCommand,
    handle: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    *,
    template: str,
    ttl: float | None,
) -> Any:
    """Run ``handle`` under the lock the options and the class describe."""
    command_name = getattr(command, "_called_as", None) or command.__module__.rsplit(".", 1)[-1]
    wait = options.pop("lock_wait", 0.0) or 0.0
    ttl_option = options.pop("lock_ttl", None)
    no_lock = options.pop("no_lock", False)
    if no_lock:
        command.stderr.write(
            f"task-locks: WARNING: {command_name} runs without its lock (--no-lock): another "
            "run may be doing the same work at the same time"
        )
        command.lease = None  # type: ignore[attr-defined]  # --no-lock: no lease to read
        return handle(*args, **options)
    name = render_lock_name(template, options, command_name)
    ttl = ttl_option if ttl_option is not None else ttl  # --lock-ttl: checked by argparse
    backend = conf.backend()
    described = " ".join(["manage.py", command_name, *map(str, args)])
    stopper = _LossStopper(command, described)
    lock = Lock(name, ttl or conf.default_ttl(), backend=backend, timeout=wait, on_lost=stopper)
    lease: Any = None
    try:
        with owner_context(command=described), _sigterm_unwinds():
            try:
                # The lock reports acquired/conflict/released/lost to the event stream
                # (the audit among its subscribers), with this policy and detail.
                with events.context(policy="exit", detail=described):
                    lease = lock.acquire()
            except LockHeld as exc:
                holder = conflict_holder(backend, exc)
                raise CommandLockHeld(
                    conflict_message(name, holder), name=name, holder=holder
                ) from None
            command.lease = lease  # type: ignore[attr-defined]  # handle() may pass lease.fence
            stopper.handling = True
            try:
                result = handle(*args, **options)
            except BaseException as exc:
                stopper.handling = False
                _release(lease, failing=True)
                if isinstance(exc, _Terminated) and stopper.stopped:
                    raise _lost_error(lease, described) from None
                raise
            stopper.handling = False
            _release(lease, failing=False)
            return result
    except _Terminated as stop:
        if stopper.stopped and lease is not None:  # the stop came just after handle()
            raise _lost_error(lease, described) from None
        raise SystemExit(128 + stop.signum) from None
    finally:
        audit.flush(timeout=5.0)


class _LossStopper:
    """The lease's ``on_lost``: record the loss, say so, and stop ``handle()`` at once.

    Called by the lease's deadline watch (or renewal) thread. ``handle()`` runs in the
    main thread under :func:`_sigterm_unwinds`, so a SIGTERM sent to that thread raises
    there, wherever it is (a ``time.sleep`` returns early too).
    """

    def __init__(self, command: BaseCommand, described: str) -> None:
        self.command = command
        self.described = described
        self.handling = False
        self.stopped = False
        self._main = threading.main_thread()
        self._interruptible = threading.current_thread() is self._main

    def __call__(self, lease: Any) -> None:
        if not self.handling:
            return
        self.command.stderr.write(
            f"task-locks: lost lock {lease.name!r} ({lease.lost_reason}); stopping "
            f"{self.described} (exit status {EX_LEASE_LOST})"
        )
        if self._interruptible and self._main.ident is not None:
            self.stopped = True
            signal.pthread_kill(self._main.ident, signal.SIGTERM)


def _lost_error(lease: Any, described: str) -> CommandError:
    return CommandError(
        f"lock {lease.name!r} was lost while {described} ran ({lease.lost_reason}); the "
        "command was stopped (its work may have overlapped another run)",
        returncode=EX_LEASE_LOST,
    )


def _release(lease: Any, *, failing: bool) -> None:
    if lease.lost.is_set():
        # Lost (maybe at its deadline, the backend not answering): nothing to release,
        # and a release over a dead link would only wait for its timeout.
        if not failing:
            raise CommandError(
                f"lock {lease.name!r} was lost: {lease.lost_reason} (the command's work may "
                "have overlapped another run)",
                returncode=EX_LEASE_LOST,
            )
        return
    try:
        lease.release()
    except LockLost as exc:
        if not failing:
            raise CommandError(
                f"{exc} (the command's work may have overlapped another run)",
                returncode=EX_LEASE_LOST,
            ) from exc


def _exit_quietly(run_from_argv: Callable[[list[str]], None], argv: list[str]) -> None:
    """From the command line: one line and status 75 on conflict, 69 when the backend is
    unreachable, 78 when it refuses the URL (password, TLS), 130 on Ctrl-C."""
    try:
        # No W001 probe first: the lock reports an unreachable backend itself, in one line.
        with checks.without_backend_probe():
            run_from_argv(argv)
    except CommandLockHeld as exc:
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        sys.exit(EX_TEMPFAIL)
    except (BackendUnavailable, BackendMisconfigured) as exc:
        # Cron tells "cannot lock now" (69) and "fix the URL" (78) from a failed job.
        status = EX_UNAVAILABLE if isinstance(exc, BackendUnavailable) else EX_CONFIG
        sys.stderr.write(f"task-locks: {str(exc).rstrip('.')}; exiting with status {status}\n")
        sys.stderr.flush()
        sys.exit(status)
    except KeyboardInterrupt:
        sys.stderr.write("task-locks: interrupted\n")
        sys.exit(128 + signal.SIGINT)


class LockedCommand(BaseCommand):
    """A ``BaseCommand`` whose ``handle()`` runs while holding ``lock_name``."""

    #: The lock: a name, or a template over the options, e.g. ``"report:{account}"``.
    lock_name: str | None = None
    #: Seconds; ``None`` uses ``TASK_LOCKS["DEFAULT_TTL"]``.
    lock_ttl: float | None = None
    #: While ``handle()`` runs: its lease (pass ``lease.fence`` to what it writes);
    #: ``None`` under ``--no-lock``.
    lease: Lease | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"{cls.__module__}.{cls.__qualname__}"
        if cls.lock_name is not None:
            _validate_template(cls.lock_name, where)
        _validate_ttl(cls.lock_ttl, where)

    def get_lock_name(self, *args: Any, **options: Any) -> str:
        """The template to fill; override to compute it (the default: ``lock_name``)."""
        if self.lock_name is None:
            return "command:{command}"
        return self.lock_name

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        self._called_as = subcommand
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        add_lock_arguments(parser)
        return parser

    def execute(self, *args: Any, **options: Any) -> Any:
        handle = self.handle
        template = _validate_template(self.get_lock_name(*args, **options), type(self).__name__)

        def locked_handle(*a: Any, **o: Any) -> Any:
            return run_locked(self, handle, a, o, template=template, ttl=self.lock_ttl)

        self.handle = locked_handle  # type: ignore[method-assign]
        try:
            return super().execute(*args, **options)
        finally:
            del self.handle

    def run_from_argv(self, argv: list[str]) -> None:
        _exit_quietly(super().run_from_argv, argv)


class locked_command:
    """Decorate a command's ``handle`` to run it under a lock (options added too)."""

    def __init__(self, name: str, *, ttl: float | None = None) -> None:
        self.template = _validate_template(name, "locked_command")
        self.ttl = _validate_ttl(ttl, "locked_command")
        self.handle: Callable[..., Any] | None = None

    def __call__(self, handle: Callable[..., Any]) -> locked_command:
        self.handle = handle
        return self

    def __set_name__(self, owner: type[BaseCommand], attr: str) -> None:
        if self.handle is None:
            raise ImproperlyConfigured(
                f"{owner.__module__}.{owner.__qualname__}.{attr}: locked_command({self.template!r}) "
                "must decorate handle: @locked_command(...) above def handle(...)"
            )
        handle, template, ttl = self.handle, self.template, self.ttl
        original_add_arguments = owner.add_arguments
        original_create_parser = owner.create_parser

        @functools.wraps(original_add_arguments)
        def add_arguments(cmd: BaseCommand, parser: argparse.ArgumentParser) -> None:
            original_add_arguments(cmd, parser)
            add_lock_arguments(parser)

        @functools.wraps(original_create_parser)
        def create_parser(cmd: BaseCommand, prog_name: str, subcommand: str, **kw: Any) -> Any:
            cmd._called_as = subcommand  # type: ignore[attr-defined]
            return original_create_parser(cmd, prog_name, subcommand, **kw)

        @functools.wraps(handle)
        def locked_handle(cmd: BaseCommand, *args: Any, **options: Any) -> Any:
            return run_locked(
                cmd,
                functools.partial(handle, cmd),
                args,
                options,
                template=template,
                ttl=ttl,
            )

        original_run_from_argv = owner.run_from_argv

        @functools.wraps(original_run_from_argv)
        def run_from_argv(cmd: BaseCommand, argv: list[str]) -> None:
            _exit_quietly(functools.partial(original_run_from_argv, cmd), argv)

        owner.run_from_argv = run_from_argv  # type: ignore[method-assign]
        owner.add_arguments = add_arguments  # type: ignore[method-assign]
        owner.create_parser = create_parser  # type: ignore[method-assign]
        setattr(owner, attr, locked_handle)


__all__ = ["CommandLockHeld", "LockedCommand", "add_lock_arguments", "locked_command"]
