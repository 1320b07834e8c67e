"""The verification scan: which keys of a range still match the round's ``verify`` predicate.

Guarantees:

- The scan reads ``lo < key <= hi [AND where]`` in the traversal's key order, in chunks of at
  most ``chunk_size`` rows, with the traversal's keyset statement (``SqlSource.range_filter``:
  the dialect's index-range form) as a derived table; the database evaluates ``CASE WHEN
  (predicate) THEN 1 ELSE 0 END`` per row and returns one row per chunk (its last key, its row
  count, its matching count). Matching keys are read only while the caller wants some, by a
  second statement bounded to the chunk's keys. Every statement is bounded by the chunk, never by
  how rare a match is, and runs under the source engine's statement timeout
  (``source.STATEMENT_TIMEOUT_S``). A row matches when the predicate is TRUE (NULL is not).
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
from .source import SqlSource


@dataclass
class ChunkMatches:
    """One scanned chunk: how many rows it read, how many matched, and (up to what the caller
    asked for) the encoded keys that matched, lowest first."""

    rows: int
    matching: int
    matched: list[str]


class _Statements:
    """The two statements of a chunk, per ``has_lo`` (a range from ``-inf`` has no lower bound).

    ``chunk``: over the traversal's chunk (``lo < key <= hi [AND where] ORDER BY key LIMIT n``, a
    derived table) one row: the chunk's last key, its row count and how many of its rows match,
    computed by the database (a one-column key: ``max``, ``count``, ``sum``; a composite key: the
    last row with window aggregates), so the scan moves one row per chunk, not one per row. ``keys``: the matching keys of ``(lo, last]`` in key order, at most ``m``, run only when
    the chunk has a match and the caller wants keys."""

    def __init__(self, source: SqlSource, predicate: str) -> None:
        self.source, self.predicate = source, predicate
        self._chunk: dict[bool, sa.Select] = {}
        self._keys: dict[bool, sa.Select] = {}

    def chunk(self, has_lo: bool) -> sa.Select:
        stmt = self._chunk.get(has_lo)
        if stmt is None:
            src = self.source
            t = src.table
            keys = [t.c[k] for k in src.key_names]
            flag = sa.case((sa.text(f"({self.predicate})"), 1), else_=0).label("keyset_match")
            inner = (
                sa.select(*keys, flag)
                .where(*src.range_filter(has_lo))
                .order_by(*keys)
                .limit(sa.bindparam("n", type_=sa.Integer()))
                .subquery("keyset_chunk")
            )
            last = [inner.c[k] for k in src.key_names]
            rows = sa.func.count()
            matching = sa.func.sum(inner.c.keyset_match)
            if src.arity == 1:  # a plain aggregate: max(key) is the chunk's last key
                stmt = sa.select(sa.func.max(last[0]), rows, matching)
            else:  # no max() of a row value: the last row, with the counts as window aggregates
                stmt = (
                    sa.select(*last, rows.over(), matching.over())
                    .order_by(*[c.desc() for c in last])
                    .limit(1)
                )
            self._chunk[has_lo] = stmt
        return stmt

    def keys(self, has_lo: bool) -> sa.Select:
        stmt = self._keys.get(has_lo)
        if stmt is None:
            src = self.source
            t = src.table
            keys = [t.c[k] for k in src.key_names]
            stmt = self._keys[has_lo] = (
                sa.select(*keys)
                .where(*src.range_filter(has_lo), sa.text(f"({self.predicate})"))
                .order_by(*keys)
                .limit(sa.bindparam("m", type_=sa.Integer()))
            )
        return stmt


def _params(source: SqlSource, lo: str, hi: str) -> dict[str, object]:
    values = source.key_params(hi, "h")
    if lo != MIN_KEY:
        values.update(source.key_params(lo, "c"))
    return values


def scan_chunks(
    source: SqlSource,
    predicate: str,
    lo: str,
    hi: str,
    chunk_size: int,
    want_keys: Callable[[], int] = lambda: 0,
) -> Iterator[ChunkMatches]:
    """Yield each chunk of ``(lo, hi]`` in key order with its count of matching rows and up to
    ``want_keys()`` of their keys (asked before each chunk; see module doc)."""
    if not predicate or not predicate.strip():
        raise ValueError("verify needs a non-empty SQL predicate")
    source.ensure_validated()
    arity = source.arity
    stmts = _Statements(source, predicate)
    with source.engine.connect() as conn:
        cursor = lo
        while cursor < hi:
            has_lo = cursor != MIN_KEY
            row = conn.execute(
                stmts.chunk(has_lo), {**_params(source, cursor, hi), "n": chunk_size}
            ).first()
            if row is None or not row[arity]:
                return
            last = encode_key(tuple(row[:arity]))
            rows, matching = int(row[arity]), int(row[arity + 1] or 0)
            want = min(want_keys(), matching)
            matched: list[str] = []
            if want > 0:
                found = conn.execute(
                    stmts.keys(has_lo), {**_params(source, cursor, last), "m": want}
                )
                matched = [encode_key(tuple(r)) for r in found]
            yield ChunkMatches(rows, matching, matched)
            if rows < chunk_size:
                return
            cursor = last


__all__ = ["ChunkMatches", "scan_chunks"]
