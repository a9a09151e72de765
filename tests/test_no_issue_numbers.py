"""Code, tests, comments and docs say the behaviour, never a tracker's number: "issue 23
bug 5" or "acceptance 7" means nothing to a reader of this repository.

An upstream project's report (``libfaketime issue #130``) names a real, findable thing and
is left alone: the check looks for the bare "issue N" / "issue-N" / "acceptance N" /
"bug N" forms.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("task_locks", "django_app", "tests", "bench", "docs", "example_project", "scripts")
FILES = ("README.md", "CHANGELOG.md", "noxfile.py", "Makefile", "pyproject.toml")
SUFFIXES = {".py", ".md", ".diff", ".toml", ".html", ".sh", ".lua", ".txt", ".cfg"}
#: Trees whose comments another change is rewriting: drop a line here once it lands.
PENDING: tuple[str, ...] = ()
NUMBERED = re.compile(
    r"\b(?:issues?[ -]\d+|issue\d+|acceptance \d+|acceptance item \d+|bug \d+)\b", re.IGNORECASE
)


def read() -> Iterator[Path]:
    for name in FILES:
        yield ROOT / name
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if path.suffix in SUFFIXES and path.is_file() and ".peers" not in path.parts:
                if relative != "tests/test_no_issue_numbers.py" and not any(
                    relative.startswith(p) for p in PENDING
                ):
                    yield path


def test_no_issue_or_acceptance_numbers() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for path in read()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if NUMBERED.search(line)
    ]
    assert found == []


def test_the_pattern_tells_a_tracker_number_from_an_upstream_one() -> None:
    for numbered in (
        "(issue 23, bug 5)",
        "Issue 12 item 3:",
        "the issue-15 record",
        "acceptance 7",
    ):
        assert NUMBERED.search(numbered), numbered
    for plain in ("libfaketime issue #130", "a known issue", "acceptance tests", "12.5 s"):
        assert not NUMBERED.search(plain), plain
