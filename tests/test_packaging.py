"""Packaging and the support matrix are wired as the README says.

`make test` builds and checks the distributions and runs the matrix's short form; the
matrix's lowest pins are the floors pyproject.toml declares; docs/installation.md's "Supported
versions" table lists only sets the noxfile runs.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _makefile_target(name: str) -> tuple[list[str], str]:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(name)}:([^\n]*)\n((?:\t[^\n]*\n)*)", text, re.M)
    assert match is not None, f"no make target {name}"
    return match.group(1).split(), match.group(2)


def _noxfile() -> tuple[dict[str, str], list[str], str]:
    text = (ROOT / "noxfile.py").read_text()
    tree = ast.parse(text)
    lowest = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "LOWEST" for t in node.targets)
    )
    ids = re.findall(r'id="([\w.-]+)"', text) + [
        f"{kind}-{version}"
        for kind, versions in re.findall(
            r'id=f"(\w+)-\{version\}",?\s*\)\s*for version in \(([^)]*)\)', text
        )
        for version in re.findall(r'"([\d.]+)"', versions)
    ]
    return lowest, ids, text


def test_make_test_builds_checks_and_runs_the_short_matrix() -> None:
    needs, _ = _makefile_target("test")
    assert "package" in needs and "matrix-short" in needs and "lint" in needs
    _, package = _makefile_target("package")
    assert "-m build" in package and "twine check --strict" in package
    assert 'grep -i "deprecat"' in package  # a setuptools deprecation warning fails it
    _, short = _makefile_target("matrix-short")
    assert "nox" in short and "-t short" in short
    _, full = _makefile_target("matrix")
    assert "nox" in full and "-t " not in full


def test_metadata_uses_spdx_license_and_the_test_extra_has_the_tools() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
    test_extra = {Requirement(r).name for r in project["optional-dependencies"]["test"]}
    assert {"build", "twine", "nox"} <= test_extra


def test_lowest_pins_are_the_declared_floors() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for extra in ("celery", "django"):
        requirements += project["optional-dependencies"][extra]
    floors = {}
    for text in requirements:
        req = Requirement(text)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors[req.name] = spec.version
    lowest, _, _ = _noxfile()
    assert set(lowest) == {"django", "celery", "kombu", "redis"}
    for name, version in lowest.items():
        assert Version(version) == Version(floors[name]), (name, version, floors[name])


def test_readme_supported_versions_are_sessions_the_noxfile_runs() -> None:
    readme = (ROOT / "docs" / "installation.md").read_text()
    table = readme.split("<!-- matrix-results -->", 1)[1].split("<!-- /matrix-results -->")[0]
    rows = re.findall(
        r"^\| ([\w.-]+)[^|]* \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$",
        table,
        re.M,
    )
    rows = [row for row in rows if row[0] != "set"]  # the header
    assert rows and rows[0][0] == "lowest"
    _, ids, text = _noxfile()
    pools = re.search(r"^POOLS = \(([^)]*)\)", text, re.M)
    assert pools, "noxfile.py names the Celery pools each set runs (POOLS)"
    every_pool = re.findall(r'"(\w+)"', pools.group(1))
    assert set(every_pool) == {"prefork", "threads", "solo", "gevent", "eventlet"}
    for row in rows:
        assert row[0] in ids, row
        assert set(re.findall(r"\w+", row[4])) <= set(every_pool), row  # pools it ran
        assert "passed" in row[5] or "failed" in row[5], row  # a result, so it ran
    # The sets run since the pools joined the smoke subset ran every one of them.
    assert any(set(re.findall(r"\w+", row[4])) == set(every_pool) for row in rows)
