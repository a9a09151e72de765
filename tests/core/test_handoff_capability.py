"""The server hand-off is a declared capability: ``Capability.SERVER_HANDOFF`` and the
``ServerHandoff`` methods come together, on every backend class and on every backend a
URL makes, so a lock never takes the hand-off path on a backend without it (or the
other way round). On Redis the server hand-off is the default; ``handoff=client`` and
``wait_replicas`` make the client hand-off. Nothing here talks to a server: making a backend sends nothing."""

from __future__ import annotations

import copy
import importlib
import pkgutil
from collections.abc import Iterator

import pytest

import task_locks.backends
from task_locks import Lock, get_backend
from task_locks._plan import Enqueue, Plan, run_against
from task_locks.backends import BUILTIN_SCHEMES, backend_class
from task_locks.backends.base import Backend, Capability, ServerHandoff
from task_locks.backends.redis import RedisBackend, RedisHandoffBackend
from task_locks.errors import InvalidArgument, MissingCapability
from task_locks.listing import describe_backend
from task_locks.types import AcquireResult, Owner

#: What a hand-off backend adds: every public name of ServerHandoff.
HANDOFF_METHODS = frozenset(name for name in vars(ServerHandoff) if not name.startswith("_"))
#: No server listens here, and none is asked: a backend's constructor sends nothing.
NOWHERE = "redis://127.0.0.1:1/0"


def _package_backends() -> Iterator[type[Backend]]:
    """Every backend class the package defines (after importing each backend module and
    the registry's classes, the DB backend included)."""
    for module in pkgutil.iter_modules(task_locks.backends.__path__):
        importlib.import_module(f"task_locks.backends.{module.name}")
    for scheme in BUILTIN_SCHEMES:
        backend_class(scheme)
    pending = [Backend]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith(("task_locks.", "django_app.")):
            yield cls


def test_the_package_has_backends_of_both_kinds() -> None:
    classes = set(_package_backends())
    assert RedisHandoffBackend in classes and RedisBackend in classes


@pytest.mark.parametrize("cls", sorted(_package_backends(), key=lambda c: c.__qualname__))
def test_a_backend_declares_the_handoff_exactly_when_it_implements_it(
    cls: type[Backend],
) -> None:
    declared = Capability.SERVER_HANDOFF in cls.capabilities
    assert declared == issubclass(cls, ServerHandoff)
    if declared:
        assert not cls.__abstractmethods__, f"{cls.__qualname__} lacks {cls.__abstractmethods__}"
    else:
        assert not {name for name in HANDOFF_METHODS if hasattr(cls, name)}


@pytest.mark.parametrize(
    "url",
    [
        NOWHERE,
        NOWHERE + "?handoff=client",
        NOWHERE + "?handoff=server",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2?handoff=server",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2?handoff=client",
        "rediss://127.0.0.1:1/0",
        "redis+sentinel://127.0.0.1:1/mymaster/0",
        "redis+sentinel://127.0.0.1:1/mymaster/0?handoff=client",
        NOWHERE + "?wait_replicas=1",
        NOWHERE + "?wait_replicas=0",
    ],
)
def test_a_url_makes_a_backend_whose_capability_and_methods_agree(url: str) -> None:
    wanted = "handoff=client" not in url and "wait_replicas=1" not in url
    for backend in (get_backend(url), RedisBackend(url)):
        assert isinstance(backend, ServerHandoff) == wanted
        assert (Capability.SERVER_HANDOFF in backend.capabilities) == wanted
        assert backend.server_handoff == wanted
        assert all(hasattr(backend, name) == wanted for name in HANDOFF_METHODS)
        # The simulator copies a backend per client: the copy keeps its kind.
        assert type(copy.copy(backend)) is type(backend)


def test_server_handoff_is_read_only() -> None:
    with pytest.raises(AttributeError):
        get_backend(NOWHERE).server_handoff = True  # type: ignore[misc]


def test_a_claim_without_the_methods_fails_where_the_class_is_written() -> None:
    with pytest.raises(TypeError, match="ServerHandoff is missing"):

        class Claims(RedisBackend):
            capabilities = RedisBackend.capabilities | {Capability.SERVER_HANDOFF}

    with pytest.raises(TypeError, match=r"Capability\.SERVER_HANDOFF is missing"):

        class Unclaimed(RedisBackend, ServerHandoff):
            capabilities = RedisBackend.capabilities


def test_the_handoff_class_made_directly_follows_its_url() -> None:
    assert RedisHandoffBackend(NOWHERE).server_handoff  # the option left out: its mode
    with pytest.raises(InvalidArgument, match="handoff=client does not fit"):
        RedisHandoffBackend(NOWHERE + "?handoff=client")


def test_the_default_says_which_handoff_it_chose_and_why() -> None:
    """``--help``, ``list`` and ``show`` print this (``describe_backend``)."""
    assert get_backend(NOWHERE).handoff_mode.startswith("server")
    assert "handoff=client" in get_backend(NOWHERE + "?handoff=client").handoff_mode
    assert "wait_replicas" in get_backend(NOWHERE + "?wait_replicas=1").handoff_mode
    assert "hand-off: server" in describe_backend(get_backend(NOWHERE))


def test_require_server_handoff_is_met_by_the_default_not_the_opt_out() -> None:
    Lock("demanding", ttl=5, backend=NOWHERE, require={"server_handoff"})
    opted_out = NOWHERE + "?handoff=client"
    lock = Lock("demanding", ttl=5, backend=opted_out, require={"server_handoff"})
    with pytest.raises(MissingCapability) as missing:
        lock.backend  # noqa: B018 - the property is what checks
    assert missing.value.missing == {Capability.SERVER_HANDOFF}


def test_a_handoff_op_against_a_plain_backend_is_refused() -> None:
    """No plan of the package does this (the lock picks its plan by the backend's kind);
    a stray one is told so, not met by an AttributeError."""

    def stray() -> Plan[AcquireResult]:
        result: AcquireResult = yield Enqueue("stray", "t", 1_000, Owner(), 0)
        return result

    with pytest.raises(NotImplementedError, match="does not hand locks off"):
        run_against(stray(), get_backend("memory://handoff-capability"))
