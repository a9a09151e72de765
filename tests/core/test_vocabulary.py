"""One vocabulary, one place: URL schemes and capabilities are each listed once.

The scheme registry (:data:`task_locks.backends.BUILTIN_SCHEMES`) and the
:class:`~task_locks.Capability` enum are the only lists; everything else that names a
scheme or a capability must read them, so these tests fail when a copy creeps back in.
"""

from __future__ import annotations

import inspect
import threading
import time
import uuid

import pytest

from task_locks import (
    AsyncLock,
    AsyncSemaphore,
    Capability,
    InvalidArgument,
    Lock,
    MissingCapability,
    Semaphore,
    backends,
    get_backend,
)
from task_locks.backends import BUILTIN_SCHEMES, PREFIX_SCHEMES, backend_class, known_schemes
from task_locks.backends.base import CAPABILITIES, Backend

#: Never contacted: construction must refuse bad input before any I/O.
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize("scheme", sorted(BUILTIN_SCHEMES))
def test_every_registered_scheme_resolves_to_a_backend_class(scheme: str) -> None:
    cls = backend_class(scheme)
    assert isinstance(cls, type) and issubclass(cls, Backend)
    module_name, _, class_name = BUILTIN_SCHEMES[scheme].partition(":")
    assert (cls.__module__, cls.__name__) == (module_name, class_name)
    assert backend_class(scheme.upper()) is cls  # schemes are case-insensitive
    # The registry is the one list: a class does not keep a second one of its schemes.
    assert not hasattr(cls, "schemes")


def test_unknown_scheme_error_lists_the_registry() -> None:
    known = known_schemes()
    assert set(BUILTIN_SCHEMES) <= set(known)
    with pytest.raises(InvalidArgument) as caught:
        backend_class("nosuch")
    message = str(caught.value)
    assert "'nosuch://'" in message
    assert message.endswith("known: " + ", ".join(f"{s}://" for s in known))


def test_registered_scheme_joins_the_known_list() -> None:
    backends.register_backend("vocab-test", "task_locks.backends.memory:MemoryBackend")
    try:
        assert "vocab-test" in known_schemes()
        assert backend_class("vocab-test") is backend_class("memory")
    finally:
        backends._registry.pop("vocab-test", None)
    assert "vocab-test" not in known_schemes()


def test_django_conf_reads_the_registry() -> None:
    from django_app import checks, conf

    assert conf.PREFIX_SCHEMES is PREFIX_SCHEMES
    assert checks.conf is conf
    assert PREFIX_SCHEMES <= set(BUILTIN_SCHEMES)
    # Only memory:// (one process, no namespace to share) takes no prefix option.
    assert set(BUILTIN_SCHEMES) - PREFIX_SCHEMES == {"memory"}
    for scheme in sorted(BUILTIN_SCHEMES):
        url = conf.with_prefix(f"{scheme}://host/0", "ns:")
        assert ("prefix=ns%3A" in url) == (scheme in PREFIX_SCHEMES), url


def test_capability_values_are_the_documented_names() -> None:
    assert {c.value for c in Capability} == {
        "fencing",
        "consensus",
        "multiprocess",
        "wakeup",
        "holders",
        "release_notice",
        "server_handoff",
        "run_check",
    }
    assert CAPABILITIES == {c.value for c in Capability}
    assert Capability("fencing") is Capability.FENCING
    assert Capability.FENCING == "fencing" and str(Capability.FENCING) == "fencing"


@pytest.mark.parametrize("scheme", sorted(BUILTIN_SCHEMES))
def test_every_backend_declares_capability_members(scheme: str) -> None:
    declared = backend_class(scheme).capabilities
    assert isinstance(declared, frozenset)
    assert all(isinstance(c, Capability) for c in declared), declared


@pytest.mark.parametrize("lock_class", [Lock, AsyncLock])
def test_unknown_capability_in_require_names_it(lock_class: type[Lock]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        lock_class("vocab", ttl=5, backend=NOWHERE, require={"fencing", "teleport"})
    message = str(caught.value)
    assert "['teleport']" in message
    assert f"known: {sorted(CAPABILITIES)}" in message
    assert caught.value.name == "vocab"


@pytest.mark.parametrize("semaphore_class", [Semaphore, AsyncSemaphore])
def test_unknown_capability_in_semaphore_require_names_it(
    semaphore_class: type[Semaphore],
) -> None:
    with pytest.raises(InvalidArgument, match=r"unknown capabilities.*\['teleport'\]"):
        semaphore_class("vocab", 2, ttl=5, backend=NOWHERE, require={"teleport"})


def test_require_as_a_bare_string_is_refused_clearly() -> None:
    with pytest.raises(InvalidArgument, match=r"collection of capability names.*'fencing'"):
        Lock("vocab", ttl=5, backend=NOWHERE, require="fencing")


def test_plain_names_and_members_are_the_same_requirement() -> None:
    by_name = Lock("vocab", ttl=5, backend=NOWHERE, require={"fencing", "holders"})
    by_member = Lock(
        "vocab", ttl=5, backend=NOWHERE, require={Capability.FENCING, Capability.HOLDERS}
    )
    assert by_name.require == by_member.require == {Capability.FENCING, Capability.HOLDERS}
    assert all(isinstance(c, Capability) for c in by_name.require)


def test_missing_capability_names_what_is_missing() -> None:
    lock = Lock("vocab", ttl=5, backend="memory://vocab", require={"consensus", "fencing"})
    with pytest.raises(MissingCapability) as caught:
        lock.backend  # noqa: B018 - the property is what checks
    assert caught.value.missing == {Capability.CONSENSUS}
    assert "requires ['consensus']" in str(caught.value)
    assert caught.value.name == "vocab"


@pytest.mark.parametrize("scheme", sorted(BUILTIN_SCHEMES))
def test_every_asyncio_method_is_a_plus_its_blocking_twin(scheme: str) -> None:
    """A backend's asyncio methods are named ``a`` + their blocking twin's name
    (``wait_release`` / ``await_release``, ``renew`` / ``arenew``), so each is found from
    the other."""
    cls = backend_class(scheme)
    names = {name for klass in cls.__mro__ for name in vars(klass)}
    asynchronous = sorted(
        name
        for name in names
        if not name.startswith("_") and inspect.iscoroutinefunction(getattr(cls, name))
    )
    assert asynchronous, "no asyncio method found"
    assert [name for name in asynchronous if name[:1] != "a" or name[1:] not in names] == []


def test_the_first_name_of_wait_release_still_waits() -> None:
    """``Backend.wait`` (public since the first backends) is ``wait_release``: it blocks
    until the release, not a poll's slice."""
    backend = get_backend(f"memory://{uuid.uuid4().hex}")
    lease = Lock("first-name", ttl=30, backend=backend).acquire()
    threading.Timer(0.05, lease.release).start()
    started = time.monotonic()
    backend.wait("first-name", 10)
    waited = time.monotonic() - started
    assert 0.04 < waited < 5, f"returned after {waited:.3f}s: not when the lock was released"
