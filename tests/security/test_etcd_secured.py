"""etcd with TLS client certificates and with RBAC users, on real servers."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from secure_fixtures import ETCD_RBAC_PREFIX, SECRET
from servers import AuthEtcdServer, Certs, TLSEtcdServer

from task_locks import BackendUnavailable, Lock, get_backend
from task_locks.errors import InvalidArgument


def test_etcds_with_a_client_certificate_locks(tls_etcd: TLSEtcdServer) -> None:
    url = tls_etcd.url(prefix="tls-basic/")
    with Lock("job", ttl=5, backend=url) as lease:
        assert get_backend(url).holder("job").fence == lease.fence  # type: ignore[union-attr]


def test_etcds_checks_the_server_certificate(tls_etcd: TLSEtcdServer, certs: Certs) -> None:
    """A server certificate from a CA we do not trust is refused, and so is a wrong name."""
    untrusted = tls_etcd.url(ca=certs.other_ca, prefix="tls-bad/", timeout=1)
    with pytest.raises(BackendUnavailable) as caught:
        Lock("job", ttl=5, backend=untrusted).acquire(timeout=0)
    assert "certificate" in str(caught.value).lower()
    # The certificate names 127.0.0.1 only: dialled as localhost, the name does not match.
    renamed = tls_etcd.url(prefix="tls-name/", timeout=1).replace("127.0.0.1", "localhost")
    with pytest.raises(BackendUnavailable):
        Lock("job", ttl=5, backend=renamed).acquire(timeout=0)
    unchecked = renamed + "&check_hostname=false"
    with Lock("job", ttl=5, backend=unchecked):
        pass


def test_etcds_without_a_client_certificate_is_refused(tls_etcd: TLSEtcdServer) -> None:
    url = f"etcds://127.0.0.1:{tls_etcd.port}?ca={tls_etcd.certs.ca}&timeout=1"
    with pytest.raises(BackendUnavailable):
        Lock("job", ttl=5, backend=url).acquire(timeout=0)


@pytest.mark.parametrize(
    "query, complaint",
    [
        ("ca=/no/such/ca.pem", "not a readable file"),
        ("key=/etc/hostname", "needs cert="),
        ("bogus=1", "unknown option"),
        ("check_hostname=maybe", "true or false"),
    ],
)
def test_etcds_options_are_checked_at_definition(query: str, complaint: str) -> None:
    with pytest.raises(InvalidArgument, match=complaint):
        get_backend(f"etcds://127.0.0.1:2379?{query}")


def test_tls_options_need_etcds() -> None:
    with pytest.raises(InvalidArgument, match="unknown option"):
        get_backend("etcd://127.0.0.1:2379?ca=/etc/hostname")


def test_rbac_user_locks_within_its_prefix(rbac_etcd: AuthEtcdServer) -> None:
    url = rbac_etcd.url(prefix=ETCD_RBAC_PREFIX)
    backend = get_backend(url)
    with Lock("job", ttl=5, backend=url) as lease:
        assert backend.renew("job", lease.token, 5000)
        assert [h.fence for h in backend.holders()] == [lease.fence]


def test_rbac_token_is_renewed_when_etcd_drops_it(rbac_etcd: AuthEtcdServer) -> None:
    """A password change invalidates the user's tokens: the next request authenticates again."""
    url = rbac_etcd.url(prefix=ETCD_RBAC_PREFIX + "renewed/")
    with Lock("before", ttl=5, backend=url):
        pass
    old_token = get_backend(url)._token  # type: ignore[attr-defined]
    rbac_etcd.invalidate_tokens()
    with Lock("after", ttl=5, backend=url, timeout=5):
        pass
    assert get_backend(url)._token not in (None, old_token)  # type: ignore[attr-defined]


def test_rbac_prefix_outside_the_role_is_a_configuration_error(
    rbac_etcd: AuthEtcdServer,
) -> None:
    url = rbac_etcd.url(prefix="not-granted/")
    with pytest.raises(InvalidArgument) as caught:
        Lock("job", ttl=5, backend=url).acquire(timeout=0)
    message = str(caught.value)
    assert "'not-granted/'" in message and "locker" in message
    assert SECRET not in message


def test_rbac_wrong_password_is_a_configuration_error(rbac_etcd: AuthEtcdServer) -> None:
    url = f"etcd://locker:{quote('wrong-' + SECRET)}@127.0.0.1:{rbac_etcd.port}"
    with pytest.raises(InvalidArgument, match="credentials"):
        Lock("job", ttl=5, backend=url).acquire(timeout=0)


def test_rbac_without_credentials_says_so(rbac_etcd: AuthEtcdServer) -> None:
    url = f"etcd://127.0.0.1:{rbac_etcd.port}?prefix={ETCD_RBAC_PREFIX}"
    with pytest.raises(InvalidArgument, match="requires authentication"):
        Lock("job", ttl=5, backend=url).acquire(timeout=0)
