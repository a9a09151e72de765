"""The Kleppmann scenario against Redis-held data, with a real process really paused.

Client 1 takes the lock, is frozen (SIGSTOP: its renewal thread stops too, exactly like
a long GC pause or a stopped VM) past its TTL; client 2 takes the lock with a newer
fence and writes; client 1 wakes up still believing it holds the lock and writes with
its old fence. The lock cannot prevent that write; the resource must refuse it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from task_locks import Lock
from task_locks.fencing import FencedStore

CLIENT_1 = textwrap.dedent(
    """
    import sys
    from task_locks import Lock, StaleFence
    from task_locks.fencing import FencedStore

    url = sys.argv[1]
    store = FencedStore(url)
    lease = Lock("invoice:7", ttl=0.5, backend=url).acquire(timeout=5)
    print("acquired", lease.fence, flush=True)
    sys.stdin.readline()  # the test freezes us here, then wakes us and says go
    try:
        store.write("invoice:7", "client 1", lease.fence)  # no check(): the pause may
        print("written", flush=True)                      # fall between check and write
    except StaleFence as refused:
        print("refused", refused.resource, refused.fence, refused.current, flush=True)
    """
)


def test_paused_holder_wakes_and_its_stale_write_is_refused(redis_url: str) -> None:
    store = FencedStore(redis_url)
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT_1, redis_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as client_1:
        try:
            assert client_1.stdout is not None and client_1.stdin is not None
            word, fence_1 = client_1.stdout.readline().split()
            assert word == "acquired"
            os.kill(client_1.pid, signal.SIGSTOP)

            # Client 2 waits for client 1's TTL to run out (its renewals are frozen).
            with Lock("invoice:7", ttl=5, backend=redis_url).acquire(timeout=5) as lease_2:
                assert lease_2.fence > int(fence_1)
                store.write("invoice:7", "client 2", lease_2.fence)

                os.kill(client_1.pid, signal.SIGCONT)
                client_1.stdin.write("go\n")
                client_1.stdin.flush()
                outcome = client_1.stdout.readline().split()
            assert client_1.wait(timeout=10) == 0
        finally:
            if client_1.poll() is None:
                os.kill(client_1.pid, signal.SIGCONT)
                client_1.kill()

    assert outcome == ["refused", "invoice:7", fence_1, str(lease_2.fence)]
    final = store.read("invoice:7")
    assert final.value == b"client 2"
    assert final.fence == lease_2.fence
