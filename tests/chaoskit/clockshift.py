"""A redis-server whose wall clock the test steps while it runs (``clockshift.c``).

libfaketime, which the clock-skew fault uses for clients, cannot run redis-server (its
jemalloc reads the clock while libfaketime initialises: libfaketime issue #130), so the
server gets this small LD_PRELOAD shim instead, built with the system's C compiler.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from servers import RedisServer

SOURCE = Path(__file__).with_name("clockshift.c")


def build(into: Path) -> Path:
    """The shim, compiled into ``into`` (raises if no C compiler: a test then fails)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("clockshift: no C compiler (cc/gcc) to build the clock shim")
    library = into / "clockshift.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE)],
        check=True,
        capture_output=True,
    )
    return library


class ClockShiftedRedis(RedisServer):
    """A :class:`RedisServer` whose wall clock is shifted by :meth:`shift`."""

    def __init__(self) -> None:
        super().__init__()
        build_dir = Path(tempfile.mkdtemp(prefix="task-locks-clockshift-", dir=self.dir))
        self.shift_file = self.dir / "clockshift-us"
        self.shift(0)
        self.env = {"LD_PRELOAD": str(build(build_dir)), "CLOCKSHIFT_FILE": str(self.shift_file)}

    def shift(self, seconds: float) -> None:
        """From now on the server's wall clock reads real time + ``seconds``."""
        self.shift_file.write_text(str(int(seconds * 1_000_000)))
