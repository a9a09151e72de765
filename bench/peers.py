"""The peers' own venv (``bench/.peers``): install the peer libraries, report versions.

A failed install is reported (with pip's reason), never dropped silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from common import PEER_VENV, PEERS, log

BENCH = Path(__file__).resolve().parent


def _pip_reason(stderr: str) -> str:
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip() and not line.startswith(("WARNING", "[notice]"))
    ]
    return (lines[-1] if lines else "pip failed without a message")[:200]


def peer_versions(python: Path, dists: Iterable[str]) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(python), "-c", code, *dists], capture_output=True, text=True, check=False
    )
    return json.loads(done.stdout) if done.returncode == 0 else {}


def ensure_peers(enabled: bool) -> tuple[str | None, dict[str, str]]:
    """The peers' python and, per peer, its version or ``"not installed: <reason>"``."""
    if not enabled:
        return None, {p: "not installed: skipped (--no-peers)" for p in PEERS}
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        log(f"creating the peers' venv {PEER_VENV}")
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(PEER_VENV)], capture_output=True, text=True
        )
        if made.returncode != 0:
            reason = f"not installed: venv creation failed: {_pip_reason(made.stderr)}"
            return None, dict.fromkeys(PEERS, reason)
    # The same redis-py, hiredis and Celery as ours, so only the lock libraries differ;
    # packaging is what kombu's Redis transport needs for the Celery peers.
    support = {
        "redis": f"redis[hiredis]=={_dist_version('redis')}",
        "celery": f"celery=={_dist_version('celery')}",
        "packaging": "packaging",
    }
    have = peer_versions(python, [*PEERS, *support, "hiredis"])
    status: dict[str, str] = {}
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    missing = [spec for dist, spec in support.items() if dist not in have]
    if missing:
        log(f"installing {' '.join(missing)} into {PEER_VENV}")
        done = subprocess.run([*pip, *missing], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            log(f"could not install {missing} for the peers: {_pip_reason(done.stderr)}")
    for peer in PEERS:
        if peer in have:
            continue
        log(f"installing {peer} into {PEER_VENV}")
        try:
            done = subprocess.run([*pip, peer], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            status[peer] = "not installed: pip timed out after 300 s"
            continue
        if done.returncode != 0:
            status[peer] = f"not installed: {_pip_reason(done.stderr)}"
    have = peer_versions(python, [*PEERS, *support, "hiredis"])
    for peer in PEERS:
        status.setdefault(peer, have.get(peer) or "not installed: not found after pip install")
    for dist in ("redis", "hiredis", "celery"):
        status[f"{dist} (peers venv)"] = have.get(dist, "not installed")
    return str(python), status


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def versions_of(peers: dict[str, str]) -> dict[str, str]:
    """The versions measured: ours, our client stack, and every installed peer."""
    return {
        "task-locks": _dist_version("task-locks"),
        "redis-py": _dist_version("redis"),
        "hiredis": _dist_version("hiredis"),
        "celery": _dist_version("celery"),
        **{k: v for k, v in peers.items() if not v.startswith("not installed")},
    }


def installed(status: dict[str, str], peer: str) -> bool:
    return not status.get(peer, "not installed").startswith("not installed")
