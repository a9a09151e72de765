"""The Redlock world's masters against a real redis-server: what Redlock reads of a master
beyond the scripts (``INFO server`` on each new connection) reads alike from both.

The scripts themselves run on the Redis model, checked by the Redis differential test.
"""

from __future__ import annotations

import redis
from servers import RedisServer

from task_locks.backends.redlock import _parse_info

from .redlock_world import RedlockMaster
from .world import Sim


def _fields(info: dict[str, str]) -> dict[str, object]:
    """What ``_Master.observe`` uses: a 40-hex run id and a whole uptime in seconds."""
    run_id = info.get("run_id", "")
    return {
        "run_id": len(run_id) == 40 and all(c in "0123456789abcdef" for c in run_id),
        "uptime": info.get("uptime_in_seconds", "").isdigit(),
    }


def _info_server(port: int) -> dict[str, str]:
    """``INFO server`` read as the backend's connect hook reads it (the raw reply)."""
    with redis.Redis(port=port) as client:
        conn = client.connection_pool.get_connection()
        try:
            conn.send_command("INFO", "server")
            return _parse_info(conn.read_response())
        finally:
            client.connection_pool.release(conn)


def test_info_server_reads_as_a_real_servers_and_a_restart_changes_its_run_id() -> None:
    server = RedisServer()
    server.start()
    try:
        before = _info_server(server.port)
        server.restart()
        after = _info_server(server.port)
    finally:
        server.cleanup()

    sim = Sim(0)
    master = RedlockMaster(sim, 0, 1.0)
    model_before = _parse_info(master.info().encode())
    sim.now = 3.5
    master.restart(0.0, quiet=True)
    sim.now = 5.0
    model_after = _parse_info(master.info().encode())

    assert _fields(before) == _fields(model_before) == {"run_id": True, "uptime": True}
    assert _fields(after) == _fields(model_after) == {"run_id": True, "uptime": True}
    assert before["run_id"] != after["run_id"]
    assert model_before["run_id"] != model_after["run_id"]
    # A restart starts the uptime again (the model's: 1.5 s after it, one whole second).
    assert int(after["uptime_in_seconds"]) < 5
    assert model_after["uptime_in_seconds"] == "1"
    assert int(model_before["uptime_in_seconds"]) >= 1000
