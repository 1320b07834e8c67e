"""The docs name exactly the connection types the hooks accept (issue 30: getting-started and
operators.md said `postgres` or `sqlite` while `mysql` works).

Walks the catalog (``hooks.keyset.SOURCE_CONN_TYPES``, the types a source, checkpoint or target
connection may have) against every line of the README and ``docs/*.md``: a list of alternatives
(`a`/`b`, `a` or `b`) that names two or more of them names all of them, and the sentences getting-started.md and operators.md
give for the source connection name exactly them. Adding a type to the hooks without the docs (or
the reverse) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _types() -> tuple[str, ...]:
    from airflow_keyset_provider.hooks.keyset import SOURCE_CONN_TYPES, STORE_CONN_TYPES

    assert STORE_CONN_TYPES == ("redis",)
    return SOURCE_CONN_TYPES


#: A list of alternatives: `a`/`b`, `a` or `b`, `a`, `b` or `c`.
LIST_RE = re.compile(r"`\w+`(?:(?:\s*/\s*|,\s*(?:or\s+)?|\s+or\s+)`\w+`)+")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_a_list_of_sql_connection_types_lists_every_one(doc: Path) -> None:
    types = _types()
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for listed in LIST_RE.findall(line):
            named = [t for t in types if f"`{t}`" in listed]
            if len(named) >= 2:
                missing = [t for t in types if t not in named]
                assert not missing, f"{doc.name}:{n} lists {named} but not {missing}: {line}"


@pytest.mark.parametrize("doc", ["getting-started.md", "operators.md"])
def test_the_source_connection_sentence_names_exactly_the_accepted_types(doc: str) -> None:
    text = (REPO / "docs" / doc).read_text()
    sentence = re.search(r"source(?:_conn_id`| connection)[^.]*?of type (.*?)[,(\n]{1}[^`]", text)
    assert sentence, f"{doc}: no sentence says which type the source connection must have"
    start = sentence.start()
    named = re.findall(r"`(\w+)`", text[start : text.index(".", start)])
    assert set(_types()) <= set(named), (doc, named)
