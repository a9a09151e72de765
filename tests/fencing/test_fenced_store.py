"""``task_locks.fencing``: Redis-held data that refuses writes from superseded holders."""

from __future__ import annotations

import asyncio

import pytest
import redis

from task_locks import BackendUnavailable, InvalidArgument, Lock, StaleFence
from task_locks.fencing import AsyncFencedStore, FencedStore, FencedValue, fenced_set


@pytest.fixture
def store(redis_url: str) -> FencedStore:
    return FencedStore(redis_url)


def test_write_then_read_returns_value_fence_and_version(store: FencedStore) -> None:
    assert store.read("invoice:7") == FencedValue(value=None, fence=None, version=0)
    assert store.write("invoice:7", "draft", 33) == 1
    assert store.read("invoice:7") == FencedValue(value=b"draft", fence=33, version=1)


def test_the_same_fence_may_write_many_times_and_a_newer_one_takes_over(
    store: FencedStore,
) -> None:
    store.write("invoice:7", "a", 33)
    store.write("invoice:7", "b", 33)
    assert store.write("invoice:7", "c", 34) == 3
    assert store.read("invoice:7") == FencedValue(b"c", 34, 3)


def test_an_older_fence_is_refused_naming_resource_presented_and_current(
    store: FencedStore,
) -> None:
    store.write("invoice:7", "from 34", 34)
    with pytest.raises(StaleFence) as refused:
        store.write("invoice:7", "from 33", 33)
    assert refused.value.resource == "invoice:7"
    assert refused.value.fence == 33
    assert refused.value.current == 34
    assert "invoice:7" in str(refused.value) and "33" in str(refused.value)
    assert store.read("invoice:7") == FencedValue(b"from 34", 34, 1)


def test_a_fenced_read_claims_the_resource_so_an_older_holder_cannot_write_after_it(
    store: FencedStore,
) -> None:
    store.write("counter", "1", 33)
    seen = store.read("counter", fence=34)
    assert seen == FencedValue(b"1", 34, 1)
    with pytest.raises(StaleFence):
        store.write("counter", "2 (from the paused holder)", 33)
    with pytest.raises(StaleFence):
        store.read("counter", fence=33)
    store.write("counter", "2", 34)
    assert store.read("counter").value == b"2"


def test_delete_drops_the_value_but_keeps_refusing_older_fences(store: FencedStore) -> None:
    store.write("report", "x", 40)
    assert store.delete("report", 41) == 2
    assert store.read("report") == FencedValue(None, 41, 2)
    with pytest.raises(StaleFence):
        store.write("report", "late", 40)


def test_fences_beyond_float_precision_compare_exactly(store: FencedStore) -> None:
    big = 2**63 + 1  # adjacent values collapse as doubles; the script compares digits
    store.write("r", "newer", big)
    with pytest.raises(StaleFence) as refused:
        store.write("r", "older", big - 1)
    assert refused.value.current == big
    store.write("r", "same", big)
    store.write("r", "longer", 10 * big)
    assert store.read("r").fence == 10 * big


def test_a_lease_can_be_passed_as_the_fence(redis_url: str, store: FencedStore) -> None:
    with Lock("invoice:9", ttl=5, backend=redis_url) as first:
        store.write("invoice:9", "one", first)
    with Lock("invoice:9", ttl=5, backend=redis_url) as second:
        store.write("invoice:9", "two", second)
    assert second.fence > first.fence
    with pytest.raises(StaleFence) as refused:
        store.write("invoice:9", "stale", first)
    assert refused.value.name == "invoice:9"
    assert refused.value.fence == first.fence
    assert refused.value.current == second.fence


def test_fenced_set_and_a_client_instance_work_like_the_store(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert fenced_set(redis_url, "r", "v1", 5) == 1
    assert fenced_set(client, "r", "v2", 6) == 2
    with pytest.raises(StaleFence):
        fenced_set(client, "r", "v0", 4)
    assert FencedStore(client).read("r") == FencedValue("v2", 6, 2)
    assert client.hget("task_locks:fenced:r", "fence") == "6"  # the mark sits beside the data


def test_prefix_separates_stores(redis_url: str) -> None:
    one, two = FencedStore(redis_url, prefix="a:"), FencedStore(redis_url, prefix="b:")
    one.write("r", "x", 10)
    two.write("r", "y", 1)
    assert (one.read("r").value, two.read("r").value) == (b"x", b"y")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.write("", "v", 1), "resource"),
        (lambda s: s.write("r", "v", -1), "fence"),
        (lambda s: s.write("r", "v", True), "fence"),
        (lambda s: s.write("r", "v", "12"), "fence"),
        (lambda s: s.write("r", {"a": 1}, 1), "value"),
        (lambda s: s.read("r", fence=1.5), "fence"),
    ],
)
def test_bad_input_is_refused_before_any_round_trip(call, message: str) -> None:
    unreachable = FencedStore(redis.Redis(port=1))  # nothing listens: no I/O may happen
    with pytest.raises(InvalidArgument, match=message):
        call(unreachable)


def test_a_dead_server_raises_backend_unavailable(redis_factory) -> None:
    server = redis_factory()
    store = FencedStore(server.url())
    store.write("r", "v", 1)
    server.kill()
    with pytest.raises(BackendUnavailable) as failed:
        store.write("r", "v", 2)
    assert failed.value.name == "r"
    assert str(server.port) in str(failed.value)


def test_async_store_shares_the_semantics(redis_url: str) -> None:
    async def scenario() -> None:
        store = AsyncFencedStore(redis_url)
        try:
            assert await store.write("r", "a", 7) == 1
            assert await store.read("r", fence=8) == FencedValue(b"a", 8, 1)
            with pytest.raises(StaleFence) as refused:
                await store.write("r", "late", 7)
            assert (refused.value.fence, refused.value.current) == (7, 8)
            assert await store.delete("r", 8) == 2
            assert await store.read("r") == FencedValue(None, 8, 2)
        finally:
            await store.client.aclose()

    asyncio.run(scenario())
