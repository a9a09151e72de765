"""The conformance suite's core bodies on secured deployments (issue 18).

``etcds`` (HTTPS, client certificate, ``--client-cert-auth``), ``etcd-rbac`` (an RBAC
user whose role covers only its prefix), ``rediss`` (TLS with a client certificate and a
password) and ``redis-acl`` (the README's least-privilege ACL user). The bodies are the
conformance suite's own, imported: the module's ``deployment`` fixture replaces the
suite's for them.
"""

from __future__ import annotations

import pytest
from secure_fixtures import ETCD_RBAC_PREFIX

from .conftest import Deployment, _unique
from .test_conformance import (  # noqa: F401 - collected here, on these deployments
    test_async_lock_hands_over_and_fences_grow,
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

SECURED = ["etcds", "etcd-rbac", "rediss", "redis-acl"]


@pytest.fixture(params=SECURED)
def deployment(request: pytest.FixtureRequest) -> Deployment:
    kind: str = request.param
    if kind == "etcds":
        url = request.getfixturevalue("tls_etcd").url(prefix=f"conf-{_unique()}/")
    elif kind == "etcd-rbac":
        url = request.getfixturevalue("rbac_etcd").url(prefix=f"{ETCD_RBAC_PREFIX}{_unique()}/")
    elif kind == "rediss":
        url = request.getfixturevalue("tls_redis").url(prefix=f"conf-{_unique()}:")
    else:  # the README's ACL covers task_locks:* only
        url = request.getfixturevalue("acl_redis").url(prefix=f"task_locks:{_unique()}:")
    slack = 1.0 if kind.startswith("etcd") else 0.3
    return Deployment(kind, url, expiry_slack=slack)
