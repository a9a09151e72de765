"""``rediss://`` against a real TLS redis-server demanding client certificates:
the ``ssl_*`` URL options reach redis-py, and a server we cannot trust is refused."""

from __future__ import annotations

import pytest
from servers import Certs, SecureRedisServer

from task_locks import BackendMisconfigured, Lock, get_backend


def test_rediss_with_a_client_certificate(tls_redis: SecureRedisServer) -> None:
    url = tls_redis.url(prefix="tls:")
    with Lock("job", ttl=5, backend=url) as lease:
        assert get_backend(url).holder("job").fence == lease.fence  # type: ignore[union-attr]


def _refused(url: str) -> None:
    """A TLS failure is a configuration error (retrying cannot help), named as TLS."""
    with pytest.raises(BackendMisconfigured, match="TLS"):
        Lock("job", ttl=5, backend=url).acquire(timeout=0)


def test_rediss_refuses_an_untrusted_server(tls_redis: SecureRedisServer, certs: Certs) -> None:
    _refused(tls_redis.url(prefix="tls:", ssl_ca_certs=certs.other_ca, socket_timeout=1))


def test_rediss_checks_the_server_name(tls_redis: SecureRedisServer) -> None:
    """The certificate names 127.0.0.1 only: dialled as localhost, the name does not match."""
    url = tls_redis.url(prefix="tls:", socket_timeout=1).replace("127.0.0.1", "localhost")
    _refused(url)
    with Lock("job", ttl=5, backend=url + "&ssl_check_hostname=false"):
        pass


def test_rediss_without_a_client_certificate_is_refused(tls_redis: SecureRedisServer) -> None:
    url = tls_redis.url(prefix="tls:", socket_timeout=1)
    url = url.split("&ssl_certfile")[0] + "&prefix=tls:&socket_timeout=1"
    _refused(url)
