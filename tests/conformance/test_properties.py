"""Property-based tests: generated names, TTLs and timeouts, the same on every backend.

Each property runs against every backend on real servers (the conformance deployments,
plus a Redis behind a Sentinel, a real Redis Cluster, and MariaDB where the machine has
them). A name that ``validate_name`` accepts must be one distinct lock everywhere: Redis
Cluster hash tags (``{``/``}`` in a name), SCAN glob characters, SQL ``LIKE`` wildcards,
case, trailing blanks and accents (case- and accent-insensitive collations), and unicode.
A value that is refused must be refused the same way by every scheme (django://,
Sentinel and Cluster URLs included), before any server is asked.

Examples are few per backend (each costs real round trips); Hypothesis keeps the
failing ones in its database only when the run is not under CI.
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from task_locks import InvalidArgument, Lock, LockHeld, get_backend
from task_locks.config import validate_ttl
from task_locks.lock import MAX_NAME_LENGTH, validate_name, validate_timeout

from .conftest import KINDS, REDIS_TOPOLOGIES, build_deployment, django_params

#: Characters that mean something to one backend or another.
TRICKY = "{}*?[]\\%_:/ .-'\"AaÉéeß\u017fK\u212a\u00a0\u3000😀"
names = st.one_of(
    st.text(alphabet=TRICKY, min_size=1, max_size=12),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24),
    st.text(alphabet="ab{}", min_size=1, max_size=6).map(lambda s: s * 3),
)

EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(params=[*KINDS, *django_params(), *REDIS_TOPOLOGIES])
def url(request: pytest.FixtureRequest) -> str:
    """Every conformance deployment, a Redis behind a Sentinel and a real 3-primary Redis
    Cluster."""
    return build_deployment(request, request.param).url


def _accepted(name: str) -> bool:
    try:
        validate_name(name)
    except InvalidArgument:
        return False
    return True


def _cleanup(url: str, *names: str) -> None:
    backend = get_backend(url)
    for name in names:
        backend.force_release(name)


@EXAMPLES
@given(first=names, second=names)
@example(first="Report", second="report")  # case-insensitive collations
@example(first="e", second="é")  # accent-insensitive collations
@example(first="a", second="a ")  # PAD SPACE collations
@example(first="}", second="{")  # Redis Cluster hash tags
@example(first="a%", second="ab")  # LIKE wildcards in a prefix
@example(first="\U0010ffff", second="\ud7ff")  # the ends of the unicode range
def test_every_accepted_name_is_one_distinct_lock(url: str, first: str, second: str) -> None:
    assume(first != second and _accepted(first) and _accepted(second))
    backend = get_backend(url)
    held = Lock(first, ttl=30, backend=url, renew=False).acquire(timeout=0)
    try:
        assert Lock(first, ttl=30, backend=url).try_acquire() is None, (
            f"{first!r} was taken twice"
        )
        other = Lock(second, ttl=30, backend=url, renew=False).try_acquire()
        assert other is not None, f"{second!r} was held because {first!r} was"
        try:
            seen = backend.holder(first)
            assert seen is not None and seen.name == first and seen.fence == held.fence
            seen_other = backend.holder(second)
            assert seen_other is not None and seen_other.name == second
            listed = [h.name for h in backend.holders(first)]
            assert first in listed
            assert all(n.startswith(first) for n in listed), listed
            other.release()
            assert backend.holder(second) is None
            assert backend.holder(first) is not None, f"releasing {second!r} freed {first!r}"
        finally:
            if not other._released:
                other.release()
        held.release()
        assert backend.holder(first) is None
    finally:
        _cleanup(url, first, second)


@EXAMPLES
@given(name=names)
def test_force_release_by_fence_frees_only_that_holder(url: str, name: str) -> None:
    assume(_accepted(name))
    backend = get_backend(url)
    try:
        first = Lock(name, ttl=30, backend=url, renew=False).acquire(timeout=0)
        first.release()
        second = Lock(name, ttl=30, backend=url, renew=False).acquire(timeout=0)
        assert second.fence > first.fence
        assert backend.force_release(name, first.fence) is False
        assert backend.holder(name) is not None, "a stale fence freed the new holder"
        assert backend.force_release(name, second.fence) is True
        assert backend.holder(name) is None
    finally:
        _cleanup(url, name)


@EXAMPLES
@given(ttl=st.floats(min_value=0.5, max_value=365 * 86400, allow_nan=False))
def test_any_valid_ttl_is_stored_with_its_expiry(url: str, ttl: float) -> None:
    backend = get_backend(url)
    name = "ttl-property"
    try:
        lease = Lock(name, ttl=ttl, backend=url, renew=False).acquire(timeout=0)
        seen = backend.holder(name)
        assert seen is not None and seen.expires_in is not None
        # etcd keeps whole seconds (rounded up); everything else keeps the milliseconds.
        assert ttl - 2.0 <= seen.expires_in <= math.ceil(ttl) + 1.0, (ttl, seen.expires_in)
        lease.release()
    finally:
        _cleanup(url, name)


bad_values = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.lists(st.integers(), max_size=2),
)


def _refusal(call: object) -> tuple[type[BaseException], str] | None:
    try:
        call()  # type: ignore[operator]
    except Exception as exc:
        return type(exc), str(exc)
    return None


@settings(max_examples=150, deadline=None)
@given(name=st.one_of(names, bad_values, st.text(min_size=MAX_NAME_LENGTH - 2)), ttl=bad_values)
def test_bad_input_is_refused_the_same_way_everywhere(
    all_urls: list[str], name: object, ttl: object
) -> None:
    expected = _refusal(
        lambda: (validate_name(name), ttl is None or validate_ttl(ttl))
    )
    for url in all_urls:
        got = _refusal(lambda url=url: Lock(name, ttl=ttl, backend=url))  # type: ignore[arg-type]
        assert got == expected, (url, got, expected)
        if expected is not None:
            assert issubclass(expected[0], InvalidArgument), expected


@settings(max_examples=60, deadline=None)
@given(timeout=bad_values)
def test_bad_timeouts_are_refused_before_any_server(all_urls: list[str], timeout: object) -> None:
    expected = _refusal(lambda: validate_timeout(timeout))
    for url in all_urls:
        got = _refusal(lambda url=url: Lock("t", ttl=1, backend=url, timeout=timeout))  # type: ignore[arg-type]
        assert got == expected, (url, got, expected)


@EXAMPLES
@given(timeout=st.floats(min_value=0, max_value=0.15))
def test_a_held_lock_is_refused_within_the_timeout(url: str, timeout: float) -> None:
    name = "timeout-property"
    holder = Lock(name, ttl=30, backend=url, renew=False).acquire(timeout=0)
    try:
        start = time.monotonic()
        with pytest.raises(LockHeld) as refused:
            Lock(name, ttl=30, backend=url).acquire(timeout=timeout)
        waited = time.monotonic() - start
        # etcd answers a held acquire in a few round trips of its own (lease grant, txn).
        assert timeout <= waited + 0.01 and waited < timeout + 2.5, (timeout, waited)
        assert refused.value.name == name
    finally:
        holder.release()


@pytest.fixture(scope="module")
def all_urls() -> list[str]:
    """One URL of every scheme, none of them reachable: refusals must not depend on
    reaching a server (a django:// backend opens no connection before its first call)."""
    from django.conf import settings

    return [
        "memory://properties",
        "redis://127.0.0.1:1/0",
        "redis+sentinel://127.0.0.1:1/mymaster",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
        "etcd://127.0.0.1:1",
        *(f"django://{alias}" for alias in sorted(settings.DATABASES)),
    ]
