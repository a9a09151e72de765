"""The conformance suite on secured deployments (TLS, RBAC, ACL users): every body, the renew(ttl=)
bodies and the property tests.

``etcds`` (HTTPS, client certificate, ``--client-cert-auth``), ``etcd-rbac`` (an RBAC
user whose role covers only its prefix), ``rediss`` (TLS with a client certificate and a
password) and ``redis-acl`` (the README's least-privilege ACL user). The bodies are the
suite's own, imported: this module's ``deployment``, ``private_deployment`` and ``url``
fixtures replace the suite's for them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from secure_fixtures import ETCD_RBAC_PREFIX, SECRET, readme_acl
from servers import AuthEtcdServer, Certs, SecureRedisServer, TLSEtcdServer

from .conftest import Deployment, unique_id
from .test_conformance import (  # noqa: F401 - collected here, on these deployments
    test_acquire_times_out_with_the_holder_named,
    test_async_lock_hands_over_and_fences_grow,
    test_async_waiters_do_not_hold_up_the_holder,
    test_backend_down_raises_backend_unavailable,
    test_bad_input_is_refused_at_definition,
    test_capabilities_are_declared_and_demanded,
    test_dead_holder_expires_within_one_ttl,
    test_fences_strictly_increase,
    test_force_release_takes_the_lock_away,
    test_holders_lists_live_locks_with_owner,
    test_mutual_exclusion_between_processes,
    test_mutual_exclusion_between_threads,
    test_release_and_renew_are_token_checked,
    test_release_wakes_a_waiter_at_once,
    test_renew_many_answers_per_lease,
    test_renewal_keeps_the_lock_past_its_ttl,
)
from .test_properties import (  # noqa: F401
    test_a_held_lock_is_refused_within_the_timeout,
    test_any_valid_ttl_is_stored_with_its_expiry,
    test_every_accepted_name_is_one_distinct_lock,
    test_force_release_by_fence_frees_only_that_holder,
)
from .test_renew_ttl import (  # noqa: F401
    test_async_renew_with_a_ttl,
    test_renew_with_a_ttl_is_token_checked,
    test_renew_with_a_ttl_sets_the_servers_expiry_and_the_watchdog_keeps_it,
)

SECURED = ["etcds", "etcd-rbac", "rediss", "redis-acl"]

def _bad_urls(kind: str) -> list[str]:
    """URLs of this deployment's scheme, with its credentials, refused at definition
    (the body checks no password is in the refusal)."""
    if kind == "etcds":
        return [
            "etcds://127.0.0.1:2379?cert=/tmp/client.crt",  # a certificate without its key
            "etcds://127.0.0.1:2379?check_hostname=maybe",
            "etcd://127.0.0.1:2379?ca=/tmp/ca.crt",  # TLS options need etcds://
        ]
    if kind == "etcd-rbac":
        return [
            f"etcd://locker:{SECRET}@127.0.0.1:notaport",
            f"etcd://locker:{SECRET}@127.0.0.1:2379?bogus=1",
        ]
    scheme, user = ("rediss", "default") if kind == "rediss" else ("redis", "locker")
    return [
        f"{scheme}://{user}:{SECRET}@127.0.0.1:notaport/0",
        f"{scheme}://{user}:{SECRET}@127.0.0.1:6379/0?socket_timeout=soon",
    ]


def _secured(request: pytest.FixtureRequest, kind: str) -> str:
    if kind == "etcds":
        return str(request.getfixturevalue("tls_etcd").url(prefix=f"conf-{unique_id()}/"))
    if kind == "etcd-rbac":
        prefix = f"{ETCD_RBAC_PREFIX}{unique_id()}/"
        return str(request.getfixturevalue("rbac_etcd").url(prefix=prefix))
    if kind == "rediss":
        return str(request.getfixturevalue("tls_redis").url(prefix=f"conf-{unique_id()}:"))
    # the README's ACL covers task_locks:* only
    return str(request.getfixturevalue("acl_redis").url(prefix=f"task_locks:{unique_id()}:"))


@pytest.fixture(params=SECURED)
def deployment(request: pytest.FixtureRequest) -> Deployment:
    kind: str = request.param
    slack = 1.0 if kind.startswith("etcd") else 0.3
    return Deployment(kind, _secured(request, kind), expiry_slack=slack, bad_urls=_bad_urls(kind))


@pytest.fixture(params=SECURED)
def url(request: pytest.FixtureRequest) -> str:
    """The property tests' backend: each secured deployment."""
    return _secured(request, request.param)


@pytest.fixture(params=SECURED)
def private_deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A secured server of its own, which the test stops (backend-down errors)."""
    kind: str = request.param
    server: TLSEtcdServer | AuthEtcdServer | SecureRedisServer
    if kind == "etcds":
        certs: Certs = request.getfixturevalue("certs")
        server = TLSEtcdServer(certs).start()
        url = server.url(timeout=1)
    elif kind == "etcd-rbac":
        server = AuthEtcdServer(
            user="locker",
            password=SECRET,
            prefix=ETCD_RBAC_PREFIX,
            root_password=SECRET + "-root",
        ).start()
        url = server.url(timeout=1, prefix=ETCD_RBAC_PREFIX)
    elif kind == "rediss":
        certs = request.getfixturevalue("certs")
        server = SecureRedisServer(
            certs,
            acl=f"user default on >{SECRET} ~* &* +@all\n",
            client=("default", SECRET),
            client_certs=True,
        ).start()
        url = server.url()
    else:
        server = SecureRedisServer(acl=readme_acl(), client=("locker", SECRET)).start()
        url = server.url(prefix="task_locks:")
    try:
        yield Deployment(kind, url, stop=server.kill)
    finally:
        server.cleanup()
