"""``make sim-mutants``: bring back each bug fixed so far, and watch the simulator fail.

Each ``tests/sim/mutants/*.diff`` is the smallest patch against the production code that
brings one bug back (its header says which). For each, a copy of ``task_locks`` (and of
``django_app``, whose ``django://`` backend the simulator runs too) is patched in a
temporary directory that comes first on ``PYTHONPATH``, and the simulator runs seeds until
one fails (the default budget, ``--seeds``; a mutant whose header has a line ``# protocol:
NAME`` runs that protocol's schedules only, the ones that reach the code it patches, so
its budget does not shrink as protocols are added). A mutant that survives the
budget is a hole in the simulator: it is reported, and the exit status is 1. So is a
patch that no longer applies (the production code moved on: ``refresh.py``). A seed that
also fails without the mutant (a finding of its own) does not count as a kill: the
search goes on after it.

    python -m tests.sim.mutate [--seeds 3000] [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent / "mutants"
BUDGET = 5000


def _protocol(diff: Path) -> list[str]:
    """``--protocol NAME`` for a mutant whose header names the protocol that can see it."""
    found = re.search(r"^# protocol: (\S+)$", diff.read_text(), re.MULTILINE)
    return ["--protocol", found.group(1)] if found else []


def run_mutant(diff: Path, seeds: int) -> tuple[str, str]:
    protocol = _protocol(diff)
    with tempfile.TemporaryDirectory(prefix="sim-mutant-") as tmp:
        # The run starts in the copy: its own directory comes first on sys.path, before
        # the editable install of the real package.
        shutil.copytree(ROOT / "task_locks", Path(tmp) / "task_locks")
        shutil.copytree(ROOT / "django_app", Path(tmp) / "django_app")
        shutil.copytree(
            ROOT / "tests" / "sim",
            Path(tmp) / "tests" / "sim",
            ignore=shutil.ignore_patterns("mutants"),
        )
        (Path(tmp) / "tests" / "__init__.py").touch()
        applied = subprocess.run(
            ["patch", "-p1", "--batch", "--silent", "-d", tmp, "-i", str(diff)],
            capture_output=True,
            text=True,
        )
        if applied.returncode != 0:
            return "DOES NOT APPLY", applied.stdout + applied.stderr
        env = dict(os.environ, PYTHONPATH=tmp)
        start = 0
        while True:
            done = subprocess.run(
                [sys.executable, "-m", "tests.sim.run", "--first", "--start", str(start),
                 "--seeds", str(seeds - start), *protocol],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
            )  # fmt: skip
            output = done.stdout + done.stderr
            if done.returncode == 0:
                return "SURVIVED", output
            found = re.search(r"^sim: seed (\d+) fails", output, re.MULTILINE)
            if done.returncode != 1 or found is None:
                return "ERROR", output
            seed = int(found.group(1))
            if _passes_unmutated(seed, protocol[1:]):
                return "killed", output
            start = seed + 1  # that seed fails without the mutant too: not this bug


def _passes_unmutated(seed: int, protocol: list[str]) -> bool:
    """Whether ``seed`` holds every invariant on the real code (so a mutant that fails
    there is what failed it)."""
    check = (
        "import sys; from tests.sim import scenario as s; "
        f"sys.exit(1 if s.run(s.generate({seed}, *{protocol!r})).violation else 0)"
    )
    # Its output (the third-party import warnings run.py filters) is not the report's.
    return (
        subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True).returncode == 0
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=BUDGET)
    parser.add_argument("--verbose", action="store_true", help="print each killer's story")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    diffs = sorted(MUTANTS.glob("*.diff"))
    if args.names:
        diffs = [d for d in diffs if d.stem in args.names]
    holes = 0
    for diff in diffs:
        began = time.perf_counter()
        verdict, output = run_mutant(diff, args.seeds)
        seconds = time.perf_counter() - began
        first = next((line for line in output.splitlines() if line.startswith("sim: seed")), "")
        violation = next(
            (line for line in output.splitlines() if line.startswith("=== VIOLATION")), ""
        )
        print(f"{verdict:14} {diff.stem} ({seconds:.0f} s) {first[5:]}")
        if violation:
            print(f"{'':14} {violation[4:]}")
        if verdict != "killed":
            holes += 1
            print(output[-3000:])
        elif args.verbose:
            print(output)
    print(f"sim-mutants: {len(diffs) - holes} of {len(diffs)} killed within {args.seeds} seeds")
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
