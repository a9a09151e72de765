"""``lease.renew(ttl=...)`` on every backend: extend with a chosen TTL.

redis-py's ``extend(additional_time, replace_ttl=True)`` and python-redis-lock's
``extend(expire)`` users look for it. After ``renew(ttl=X)`` the server's expiry is
about X from now, and the watchdog renews to X (not the TTL the lock was taken with).
Runs on every conformance deployment and on Redis Sentinel and Cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from task_locks import AsyncLock, InvalidArgument, Lock, LockLost, get_backend
from task_locks.types import Holder

from .conftest import REDIS_TOPOLOGIES, Deployment, build_deployment, deployment_params


@pytest.fixture(params=deployment_params(*REDIS_TOPOLOGIES))
def deployment(request: pytest.FixtureRequest) -> Deployment:
    """Every conformance deployment, and Redis behind a Sentinel and as a Cluster."""
    return build_deployment(request, request.param)


def tolerance(deployment: Deployment) -> float:
    # etcd grants whole seconds and reports the remainder rounded down (+1 as a bound).
    return 1.5 if deployment.kind.startswith("etcd") else 0.5


def assert_expires_in(holder: Holder | None, ttl: float, deployment: Deployment) -> None:
    assert holder is not None and holder.expires_in is not None
    slack = tolerance(deployment)
    assert ttl - slack <= holder.expires_in <= ttl + slack, (holder.expires_in, ttl)


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


def test_renew_with_a_ttl_sets_the_servers_expiry_and_the_watchdog_keeps_it(
    deployment: Deployment,
) -> None:
    backend = get_backend(deployment.url)
    lease = Lock("relet", ttl=1, backend=deployment.url).acquire(timeout=0)
    fence = lease.fence
    lease.renew(ttl=4)
    assert lease.ttl == 4.0
    assert_expires_in(backend.holder("relet"), 4, deployment)
    assert 3.0 < lease.remaining <= 4.0
    # The watchdog now renews every 4/3 s, to 4 s: past the first TTL the lock is still
    # ours and the server's expiry is still about 4 s away.
    renewed = lease.renewals
    wait_until(lambda: lease.renewals > renewed, 4, "a watchdog renewal")
    assert_expires_in(backend.holder("relet"), 4, deployment)
    holder = backend.holder("relet")
    assert holder is not None and holder.fence == fence and holder.token == lease.token
    assert Lock("relet", ttl=1, backend=deployment.url).try_acquire() is None

    lease.renew(ttl=1.5)  # shorter works too; the local deadline shrinks at once
    assert lease.remaining <= 1.5
    assert_expires_in(backend.holder("relet"), 1.5, deployment)
    lease.renew()  # without ttl: the last TTL chosen
    assert_expires_in(backend.holder("relet"), 1.5, deployment)

    with pytest.raises(InvalidArgument, match="ttl"):
        lease.renew(ttl=0)
    with pytest.raises(InvalidArgument, match="ttl"):
        lease.renew(ttl="soon")  # type: ignore[arg-type]
    assert lease.ttl == 1.5 and lease.held
    lease.release()
    with pytest.raises(LockLost):
        lease.renew(ttl=10)
    assert backend.holder("relet") is None


def test_renew_with_a_ttl_is_token_checked(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    first = Lock("relet-checked", ttl=5, backend=deployment.url, renew=False).acquire(timeout=0)
    assert backend.force_release("relet-checked")  # as if its TTL ran out
    second = Lock("relet-checked", ttl=5, backend=deployment.url).acquire(timeout=0)
    with pytest.raises(LockLost):  # NotOwned is a LockLost
        first.renew(ttl=30)
    assert first.lost.is_set()
    holder = backend.holder("relet-checked")
    assert holder is not None and holder.token == second.token
    assert_expires_in(holder, 5, deployment)  # the new holder's TTL is untouched
    second.release()


def test_async_renew_with_a_ttl(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)

    async def scenario() -> None:
        lease = await AsyncLock("arelet", ttl=1, backend=deployment.url).acquire(timeout=0)
        await lease.renew(ttl=4)
        assert lease.ttl == 4.0
        assert_expires_in(await backend.aholder("arelet"), 4, deployment)
        renewed = lease.renewals
        deadline = time.monotonic() + 4
        while lease.renewals == renewed:
            assert time.monotonic() < deadline, "no watchdog renewal within 4 s"
            await asyncio.sleep(0.02)
        assert_expires_in(await backend.aholder("arelet"), 4, deployment)
        assert lease.held
        with pytest.raises(InvalidArgument):
            await lease.renew(ttl=-1)
        await lease.release()
        with pytest.raises(LockLost):
            await lease.renew(ttl=4)
        await backend.aclose()

    asyncio.run(scenario())
