"""MkDocs hook: tandem's docstrings cross-reference in Sphinx's roles
(``:class:`~tandem.comm.group.GroupComm```), which Markdown renders as the role's
name in front of a code span. Keep the code span and drop the role; ``~`` (Sphinx's
"show the last name only") is honoured."""

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|mod|exc|obj|const|ref):<code>(~)?([^<]*)</code>")


def _code(match: re.Match) -> str:
    name = match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_code, html)
