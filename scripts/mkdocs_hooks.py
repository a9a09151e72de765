"""MkDocs hooks (mkdocs.yml ``hooks:``) for the API reference pages.

The docstrings are written for Sphinx-style readers (``:class:`Lease```); mkdocstrings
renders the role's text as it is, so ":class:" would be printed before every name. The
role is dropped and a ``~`` (Sphinx's "show the last part") is honoured.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_name, html)
