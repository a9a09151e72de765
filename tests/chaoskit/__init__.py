"""A small Jepsen-style harness: client processes, a nemesis, a history and its checker.

- :mod:`.clock`     the one clock every history timestamp comes from (real CLOCK_MONOTONIC,
                    even in a client whose clock libfaketime skews)
- :mod:`.history`   invoke / completion records, one JSON line each
- :mod:`.client`    the client process: acquire -> write(fence) -> release, in a loop
- :mod:`.resources` the protected resource, guarded three ways (or not at all)
- :mod:`.proxy`     a fault-injecting TCP proxy (latency, blackhole, reset)
- :mod:`.clusters`  the lock services under test and their fault hooks
- :mod:`.nemesis`   the faults, injected while the clients run
- :mod:`.checker`   reads a history: overlaps, stale writes, lost writes
- :mod:`.scenario`  one backend x fault run, from servers up to a checked result
- :mod:`.report`    the table, printed and written as Markdown
"""
