"""``make sim``: many seeds, or one replayed as a story.

    python -m tests.sim.run --seeds 1000000 [--start 0] [--jobs 2]
    python -m tests.sim.run --seed 209          # the story of one seed (shrunk if it fails)

Exit status 1 if any seed broke an invariant; each failing seed is printed with the story
of its shrunk schedule (the first few in full).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import warnings
from collections import Counter

# Third-party import noise when etcd3gw loads (as pyproject.toml's pytest filters say):
# futurist imports eventlet, which warns it is deprecated and imports dnspython's DSA.
warnings.filterwarnings("ignore", r"\s*Eventlet is deprecated")
warnings.filterwarnings("ignore", "DSA is deprecated")

from . import scenario as sim  # noqa: E402

STORIES = 3


def _chunk(bounds: tuple[int, int, str | None]) -> tuple[list[int], int, int, float]:
    start, stop, protocol = bounds
    failing, steps, seconds = sim.explore(range(start, stop), protocol)
    return failing, steps, stop - start, seconds


def explore(seeds: int, start: int, jobs: int, protocol: str | None) -> int:
    chunk = max(1, min(2000, seeds // (jobs * 4) or 1))
    bounds = [
        (s, min(s + chunk, start + seeds), protocol) for s in range(start, start + seeds, chunk)
    ]
    began = time.perf_counter()
    failing: list[int] = []
    steps = done = 0
    # A fresh process every ten chunks: the simulator's memory grows with the schedules a
    # process has run (about 110 KB each), so a million seeds would not fit otherwise.
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=10) as pool:
        for found, n_steps, n_seeds, _ in pool.imap_unordered(_chunk, bounds):
            failing += found
            steps += n_steps
            done += n_seeds
            elapsed = time.perf_counter() - began
            print(
                f"\r{done:,}/{seeds:,} seeds, {len(failing)} failing, "
                f"{done / elapsed:,.0f} schedules/s",
                end="",
                flush=True,
            )
    elapsed = time.perf_counter() - began
    print()
    protocols = Counter(
        sim.generate(s, protocol).protocol for s in range(start, min(start + 200, start + seeds))
    )
    print(
        f"sim: {seeds:,} seeds ({', '.join(sorted(protocols))}) in {elapsed:.1f} s with {jobs} "
        f"process(es): {seeds / elapsed:,.0f} schedules/s, {steps / elapsed:,.0f} steps/s, "
        f"{steps / max(1, seeds):.0f} steps per schedule"
    )
    if not failing:
        print("sim: every schedule held every invariant")
        return 0
    failing.sort()
    print(
        f"sim: {len(failing)} failing seed(s): {failing[:50]}{' ...' if len(failing) > 50 else ''}"
    )
    for seed in failing[:STORIES]:
        print_story(seed, protocol)
    return 1


def first_failure(seeds: int, start: int, protocol: str | None) -> int:
    """One process, seed after seed, until one fails (``make sim-mutants``)."""
    began = time.perf_counter()
    with sim.fewer_collections():
        seed = next((s for s in range(start, start + seeds) if _fails(s, protocol)), None)
    if seed is not None:
        elapsed = time.perf_counter() - began
        print(f"sim: seed {seed} fails after {seed - start + 1} seeds ({elapsed:.1f} s)")
        print_story(seed, protocol)
        return 1
    print(f"sim: {seeds} seeds, no failure ({time.perf_counter() - began:.1f} s)")
    return 0


def _fails(seed: int, protocol: str | None) -> bool:
    return sim.run(sim.generate(seed, protocol)).violation is not None


def print_story(seed: int, protocol: str | None = None) -> bool:
    scenario = sim.generate(seed, protocol)
    outcome = sim.run(scenario)
    if outcome.violation:
        scenario = sim.shrink(scenario)
    violation, lines = sim.story(scenario)
    print(f"\n=== seed {seed}" + (" (shrunk schedule)" if outcome.violation else "") + " ===")
    print("\n".join(lines))
    print(f"=== {'VIOLATION: ' + violation if violation else 'every invariant held'}")
    print(f"replay: make sim SEED={seed}")
    return violation is None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=1_000_000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None, help="replay one seed as a story")
    parser.add_argument("--protocol", choices=sim.PROTOCOLS, default=None)
    parser.add_argument("--first", action="store_true", help="stop at the first failing seed")
    args = parser.parse_args(argv)
    if args.seed is not None:
        return 0 if print_story(args.seed, args.protocol) else 1
    if args.first:
        return first_failure(args.seeds, args.start, args.protocol)
    return explore(args.seeds, args.start, args.jobs, args.protocol)


if __name__ == "__main__":
    sys.exit(main())
