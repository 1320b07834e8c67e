"""The verification scan: which keys of a range still match the round's ``verify`` predicate.

Guarantees:

- The scan reads ``lo < key <= hi [AND where]`` in the traversal's key order, in chunks of at
  most ``chunk_size`` rows, with the traversal's keyset statement (``SqlSource.range_filter``:
  the dialect's index-range form), selecting the key columns and one flag, ``CASE WHEN
  (predicate) THEN 1 ELSE 0 END``: each statement is bounded by the chunk, never by how rare a
  match is, and runs under the source engine's statement timeout (``source.STATEMENT_TIMEOUT_S``).
  A row matches when the predicate is TRUE (NULL is not a match).
- The predicate is the DAG author's SQL, trusted like ``where``: nothing is bound into it, it is
  never read from Redis, and no row data is logged (keys only, as the rest of the engine does).
- Memory: one chunk, plus the first ``max_keys`` matching keys; the count is a number.
- ``pace(rows)`` is called after every chunk (the stream's governor: ``core/rounds/verification``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import sqlalchemy as sa

from ..keys import MIN_KEY, encode_key
from .fetch import compile_fetcher, materialize, release
from .source import SqlSource


@dataclass
class ChunkMatches:
    """One scanned chunk: how many rows it read and the encoded keys that matched."""

    rows: int
    matched: list[str]


def _statement(source: SqlSource, predicate: str, has_lo: bool) -> sa.Select:
    t = source.table
    keys = [t.c[k] for k in source.key_names]
    flag = sa.case((sa.text(f"({predicate})"), 1), else_=0).label("keyset_verify_match")
    return (
        sa.select(*keys, flag)
        .where(*source.range_filter(has_lo))
        .order_by(*keys)
        .limit(sa.bindparam("n", type_=sa.Integer()))
    )


def scan_chunks(
    source: SqlSource, predicate: str, lo: str, hi: str, chunk_size: int
) -> Iterator[ChunkMatches]:
    """Yield each chunk of ``(lo, hi]`` in key order with its matching keys (see module doc)."""
    if not predicate or not predicate.strip():
        raise ValueError("verify needs a non-empty SQL predicate")
    source.ensure_validated()
    arity = source.arity
    types = [source.table.c[k].type for k in source.key_names] + [sa.Integer()]
    fetchers: dict[bool, Callable[[str, str, int], object]] = {}
    with source.engine.connect() as conn:
        cursor = lo
        while cursor < hi:
            has_lo = cursor != MIN_KEY
            fetch = fetchers.get(has_lo)
            if fetch is None:

                def key_values(c: str, h: str, has_lo: bool = has_lo) -> dict[str, object]:
                    values = source.key_params(h, "h")
                    if has_lo:
                        values.update(source.key_params(c, "c"))
                    return values

                fetch = fetchers[has_lo] = compile_fetcher(
                    conn, _statement(source, predicate, has_lo), types, key_values, lazy=False
                )
            raw = fetch(cursor, hi, chunk_size)
            rows = materialize(raw)  # type: ignore[arg-type]
            release(raw)  # type: ignore[arg-type]
            if not rows:
                return
            matched = [encode_key(tuple(r[:arity])) for r in rows if r[arity]]
            yield ChunkMatches(len(rows), matched)
            if len(rows) < chunk_size:
                return
            cursor = encode_key(tuple(rows[-1][:arity]))


__all__ = ["ChunkMatches", "scan_chunks"]
