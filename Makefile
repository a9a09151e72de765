# task-locks: `make demo` shows it working, `make test` proves it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: help install servers lint package docs matrix-short matrix sim-short test chaos demo bench clean

help:
	@echo "make demo   - run the example project's main job on the embedded default (no server needed)"
	@echo "make test   - install what the tests need, start their servers, run lint + the suite"
	@echo "make docs   - the documentation site (mkdocs.yml, docs/) in strict mode into build/site"
	@echo "make matrix - the support matrix (noxfile.py): every pinned Django/Celery/redis-py set"
	@echo "make chaos  - the long fault-injection suite and the full fault matrix, with their reports"
	@echo "make bench  - benchmarks against the peers (bench/results.md, bench/results.png)"
	@echo "make sim    - the deterministic simulation's long form (SEEDS=1000000, SIM_JOBS=2);"
	@echo "              make sim SEED=<n> replays one seed and prints its story"
	@echo "make sim-mutants - bring back each fixed bug (tests/sim/mutants) and show the sim failing"
	@echo "make sim-short - the simulation's short form (SIM_SHORT_SEEDS=3000), part of make test"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,test,bench,docs]'
	touch $(STAMP)

# The demo needs only the package with its Celery and Django extras.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

servers:
	bash scripts/install-servers.sh

lint: install
	$(VENV)/bin/ruff check task_locks django_app tests bench example_project
	$(VENV)/bin/mypy

# The sdist and wheel build, and their metadata passes twine's check.
package: install
	rm -rf build/dist && mkdir -p build
	@$(PY) -m build --outdir build/dist . > build/package.log 2>&1 || { cat build/package.log; exit 1; }
	@! grep -i "deprecat" build/package.log || { echo "package: setuptools deprecation warnings (above)"; exit 1; }
	$(VENV)/bin/twine check --strict build/dist/*

# The documentation site in strict mode: any warning (a broken link or anchor, a reference
# to a name without a docstring page) fails it. Output in build/site (gitignored).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# The support matrix (noxfile.py): each session its own virtualenv under .nox/ with pinned
# Django, Celery and redis-py, running a smoke subset. `make test` runs the short form
# (the lowest pins; the suite itself runs on the newest), reusing its virtualenv.
matrix-short: install servers
	$(VENV)/bin/nox --reuse-venv=yes -t short

matrix: install servers
	$(VENV)/bin/nox --reuse-venv=yes

# Three pytest workers, one test file each at a time: the suite waits on servers and
# worker processes far more than it computes (about 12 min in one process, 11 in two
# workers, 8 in three; three keep this 2-CPU machine's two CPUs about two-thirds busy).
PYTEST_WORKERS ?= -n 3 --dist loadfile

test: install servers lint package docs matrix-short sim-short
	$(PY) -m pytest -p no:cacheprovider $(PYTEST_WORKERS) $(PYTEST_ARGS)

chaos: install servers
	$(PY) -m pytest -p no:cacheprovider tests/chaos tests/conformance/faults -m chaos --chaos-long $(PYTEST_ARGS)

# The deterministic simulation (tests/sim/): the real lock code on virtual time, network
# and Redis. SEED=<n> replays one schedule as a story; otherwise SEEDS schedules in
# SIM_JOBS processes, printing schedules per second and the shrunk story of any failure.
SEEDS ?= 1000000
SIM_JOBS ?= 2
MUTANT_SEEDS ?= 5000

sim: install
	$(PY) -m tests.sim.run $(if $(SEED),--seed $(SEED),--seeds $(SEEDS) --jobs $(SIM_JOBS))

sim-mutants: install
	$(PY) -m tests.sim.mutate --seeds $(MUTANT_SEEDS)

# The simulation's short form (tests/sim/): every front end, a few thousand seeds, in
# SIM_JOBS processes (about 25 s here); `make sim` runs the long form.
SIM_SHORT_SEEDS ?= 3000

sim-short: install
	$(PY) -m tests.sim.run --seeds $(SIM_SHORT_SEEDS) --jobs $(SIM_JOBS)

demo: $(DEMO_STAMP)
	$(PY) example_project/demo.py

bench: install servers
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .nox tests/artifacts bench/.peers
