"""MkDocs hooks (mkdocs.yml ``hooks:``).

- The quick starts live in the README (where a newcomer reads first, and where
  tests/test_readme.py runs them); ``docs/quickstart.md`` includes the README's sections
  by title (``<!-- include README: ## Quick starts -->``) with the README's ``docs/...``
  links made relative to the site, so the site has them without a second copy.
- The docstrings are written for Sphinx-style readers (``:class:`Lease```); mkdocstrings
  renders the role's text as it is, so ":class:" would be printed before every name. The
  role is dropped and a ``~`` (Sphinx's "show the last part") is honoured, and a
  reStructuredText literal-block marker (a paragraph ``::``, or one ending in ``::``)
  reads as the colon it stands for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")
LITERAL_MARKER = re.compile(r"(?<=\S)::</p>")
INCLUDE = re.compile(r"^<!-- include README: (#+ .+?) -->$", re.M)


def _name(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def readme_section(readme: str, title: str) -> str:
    """The README's section under the heading ``title`` (up to the next heading of its
    level or above, outside code blocks), its links into ``docs/`` made relative to the
    site's root."""
    level = len(title.split(" ", 1)[0])
    lines = readme.splitlines(keepends=True)
    start = lines.index(f"{title}\n")
    fenced = False
    for end in range(start + 1, len(lines)):
        if lines[end].startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", lines[end]):
            break
    else:
        end = len(lines)
    return "".join(lines[start:end]).replace("](docs/", "](")


def on_page_markdown(markdown: str, config: Any, **kwargs: Any) -> str:
    if "<!-- include README:" not in markdown:
        return markdown
    readme = (Path(config["config_file_path"]).parent / "README.md").read_text()
    return INCLUDE.sub(lambda m: readme_section(readme, m.group(1)), markdown)


def on_page_content(html: str, **kwargs: Any) -> str:
    html = ROLE.sub(_name, html).replace("<p>::</p>", "")
    return LITERAL_MARKER.sub(":</p>", html)
