"""Session fixtures for the secured servers: TLS, etcd RBAC, Redis ACL users (imported by
tests/conftest.py).

A throwaway CA and certificates (``openssl``), etcd on HTTPS with ``--client-cert-auth``,
etcd with RBAC, Redis on TLS demanding a client certificate, and Redis whose users are
the README's least-privilege ACL. Every password here is :data:`SECRET` (or contains it),
so a test can grep everything task-locks printed for it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import AuthEtcdServer, Certs, SecureRedisServer, TLSEtcdServer

#: Recognisable in any output: no log line, error or page may ever contain it.
SECRET = "S3cr3t-Hunter2-Pw"
#: The page with the least-privilege ACL blocks (once in the README).
README = Path(__file__).resolve().parents[1] / "docs" / "security.md"
#: The marker above the README's ACL block (the block the tests load, verbatim).
ACL_MARKER = "<!-- not-run: the lock user's Redis ACL; tests/security load this block -->"
#: Prefix the etcd RBAC role covers.
ETCD_RBAC_PREFIX = "rbac-locks/"


#: The marker above the README's read-only ACL block.
VIEWER_MARKER = "<!-- not-run: the read-only Redis ACL; tests/security load this block -->"


def readme_acl(password: str = SECRET, marker: str = ACL_MARKER) -> str:
    """An ACL block of the README (the lock user's by default), its password filled in."""
    text = README.read_text()
    at = text.index(marker)
    block = re.search(r"```\w*\n(.*?)```", text[at:], re.S)
    assert block is not None, "the README's ACL block is missing"
    return block.group(1).replace("PASSWORD", password)


def key_body(path: object) -> list[str]:
    """The base64 lines of a PEM private key file (any one of them would be a leak)."""
    lines = Path(str(path)).read_text().splitlines()
    return [line for line in lines if line and not line.startswith("-----")]


def _have(binary: str) -> None:
    if shutil.which(binary) is None:
        pytest.skip(f"no {binary} binary (scripts/install-servers.sh installs it)")


@pytest.fixture(scope="session")
def certs() -> Iterator[Certs]:
    _have("openssl")
    directory = Path(tempfile.mkdtemp(prefix="task-locks-certs-"))
    yield Certs(directory).make()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def tls_etcd(certs: Certs) -> Iterator[TLSEtcdServer]:
    _have("etcd")
    server = TLSEtcdServer(certs).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def rbac_etcd() -> Iterator[AuthEtcdServer]:
    _have("etcd")
    server = AuthEtcdServer(
        user="locker", password=SECRET, prefix=ETCD_RBAC_PREFIX, root_password=SECRET + "-root"
    ).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def tls_redis(certs: Certs) -> Iterator[SecureRedisServer]:
    """Redis on TLS only, demanding a client certificate, with a password on ``default``."""
    _have("redis-server")
    server = SecureRedisServer(
        certs,
        acl=f"user default on >{SECRET} ~* &* +@all\n",
        client=("default", SECRET),
        client_certs=True,
    )
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def acl_redis() -> Iterator[SecureRedisServer]:
    """Redis whose ``locker`` and ``viewer`` users have exactly the README's ACLs; ``admin``
    has everything."""
    _have("redis-server")
    acl = readme_acl() + readme_acl(SECRET + "-viewer", VIEWER_MARKER)
    acl += f"user admin on >{SECRET}-admin ~* &* +@all\n"
    server = SecureRedisServer(acl=acl, client=("locker", SECRET)).start()
    yield server
    server.cleanup()
