"""PostgreSQL behind the ``Dialect`` interface (catalog reads in ``catalog``, the wait in
``commit_order``; this module decides and words the refusals).

- uniqueness: a valid unique index without predicate or expression (``catalog.unique_indexes``);
- text keys: the column's collation, provider included, sorts by code point
  (``catalog.sorts_by_code_point``);
- commit order: refuses a standby and a key fed by a sequence with ``CACHE > 1`` unless
  ``settle_seconds`` opts in; then waits, bounded, for every transaction of the database that was
  open when the bound was read, prepared ones included (``commit_order.settle``);
- planner: ``EXPLAIN`` estimates, ``TABLESAMPLE SYSTEM`` quantiles;
- timeouts: ``statement_timeout`` and ``lock_timeout``;
- row errors: by SQLSTATE class (22 data exception, 23 integrity constraint violation: the row;
  40001/40P01 serialization failure and deadlock, 55P03 lock not available, 57014 query canceled:
  transient).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...errors import ConfigurationError, KeyValidationError
from ...keys import MIN_KEY, encode_key
from .. import catalog, commit_order
from .base import Dialect, RowErrorKind

if TYPE_CHECKING:
    from ..catalog import IndexInfo
    from ..relation import Relation

log = logging.getLogger(__name__)

_RETRY_SQLSTATES = {"40001", "40P01", "55P03", "57014"}


class PostgresqlDialect(Dialect):
    name = "postgresql"

    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        return catalog.unique_indexes(conn, src.rel)

    def check_collation(self, src: Relation, key_cols: Sequence[sa.Column]) -> None:
        """Every text key column sorts by code point, as the cursors in Redis compare."""
        text_cols = [c.name for c in key_cols if isinstance(c.type, sa.String)]
        if not text_cols:
            return
        with src.engine.connect() as conn:
            found = catalog.collations(conn, src.rel, text_cols)
        for c in found:
            if not catalog.sorts_by_code_point(c):
                provider = {"c": "libc", "i": "ICU", "b": "builtin"}.get(c.provider, c.provider)
                raise KeyValidationError(
                    f"text key column {c.column!r} uses collation {c.collation!r}, which does not order by "
                    "code point, so cursors compared in Redis would disagree with the database. Fix: "
                    f'ALTER TABLE {src.qualified_name} ALTER COLUMN {c.column} TYPE text COLLATE "C" '
                    f"(or page by another key). It sorts by the {provider} locale {c.locale!r}."
                )

    def check_commit_order(self, src: Relation, conn: sa.Connection) -> None:
        """Refuse a standby (its ``pg_locks`` lacks the primary's transactions) and a key fed by a
        sequence with ``CACHE > 1`` (a session may use a cached, lower value at any later time).
        A ``settle_seconds`` window is the explicit opt-in: then the round is only as safe as it."""
        opted_in = src.settle_seconds > 0
        if catalog.in_recovery(conn):
            if not opted_in:
                raise ConfigurationError(
                    f"the source of {src.qualified_name!r} is a standby (pg_is_in_recovery() is true): the "
                    "primary's open transactions are invisible here, so no key order can be proven at the "
                    "round's end. Fix: plan against the primary, or opt in to a settle window with "
                    "settle_seconds > 0 (keys committed later than that window are missed)."
                )
            log.warning(
                "%s: planning on a standby; only the settle window of %.1f s protects late keys",
                src.qualified_name,
                src.settle_seconds,
            )
        int_keys = [
            c
            for c, kind in zip(src.key_names, src.key_kinds, strict=True)
            if kind in ("int", "decimal")
        ]
        if not int_keys:
            return
        for seq in catalog.key_sequences(conn, src.rel, int_keys):
            if seq.cache <= 1:
                continue
            if not opted_in:
                raise ConfigurationError(
                    f"key column {seq.column!r} of {src.qualified_name!r} is fed by sequence {seq.sequence!r} "
                    f"with CACHE {seq.cache}: a session holding cached values can insert a key below one "
                    "already committed, at any later time, after its round closed. Fix: ALTER SEQUENCE "
                    f"{seq.sequence} CACHE 1 (identity: ALTER TABLE {src.qualified_name} ALTER COLUMN "
                    f"{seq.column} SET CACHE 1), or opt in to a settle window with settle_seconds > 0."
                )
            log.warning(
                "%s: key %s is fed by %s with CACHE %d; only the settle window of %.1f s protects "
                "late keys",
                src.qualified_name,
                seq.column,
                seq.sequence,
                seq.cache,
                src.settle_seconds,
            )

    def settle(self, src: Relation, conn: sa.Connection) -> None:
        commit_order.settle(conn, src.commit_wait_timeout, src.settle_seconds, src.qualified_name)

    def estimate_rows(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> int:
        """The planner's estimate (``EXPLAIN``, no row read)."""
        sql, params_for = src.driver_call(stmt)
        plan: Any = conn.exec_driver_sql(
            "EXPLAIN (FORMAT JSON) " + sql, params_for(params)
        ).scalar()
        doc = plan if isinstance(plan, list) else json.loads(plan)
        return int(doc[0]["Plan"]["Plan Rows"])

    def sampled_cuts(
        self,
        src: Relation,
        conn: sa.Connection,
        lo: str,
        params: dict[str, Any],
        est: int,
        parts: int,
        sample_rows: int,
    ) -> list[str] | None:
        """Cuts from a block sample; None when the sample is too small to cut (< 4 rows a part)."""
        # Block sampling of a table stored in key order draws whole runs of neighbouring
        # keys, so read at least ~2048 blocks and thin them at random back to sample_rows.
        # Blocks from the file sizes (a partitioned parent's relpages is -1, a never-analysed
        # table's 0): TABLESAMPLE on a parent samples each partition at that percentage.
        pages, leaves = catalog.table_pages(conn, src.rel)
        fraction = min(1.0, max(sample_rows / max(est, 1), 2048 / max(pages, 1)))
        keep = min(1.0, sample_rows / max(est * fraction, 1))
        src.last_sample_percent = 100.0 * fraction
        log.info(
            "%s: sampling %.2f%% of %d blocks (%d relation(s)) for ~%d estimated rows",
            src.qualified_name,
            100.0 * fraction,
            pages,
            leaves,
            est,
        )
        sampled = src.table.tablesample(sa.func.system(100.0 * fraction), name="s")
        scols = [sampled.c[k] for k in src.key_names]
        stmt = sa.select(*scols).where(*src.range_filter(lo != MIN_KEY, on=sampled))
        if keep < 1.0:
            stmt = stmt.where(sa.func.random() < keep)
        sample = sorted(tuple(r) for r in conn.execute(stmt, params))
        if len(sample) < parts * 4:
            return None
        step = len(sample) / parts
        picks = [sample[round(step * i) - 1] for i in range(1, parts)]
        return sorted({encode_key(p) for p in picks})

    def session_statements(self, statement_s: float, lock_s: float) -> list[str]:
        return [
            f"SET statement_timeout = {int(statement_s * 1000)}",
            f"SET lock_timeout = {int(lock_s * 1000)}",
        ]

    def classify_row_error(self, exc: BaseException) -> RowErrorKind | None:
        orig = getattr(exc, "orig", exc)  # psycopg 3: sqlstate; psycopg2: pgcode
        code = str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "")
        if code[:2] in ("22", "23"):
            return "row"
        if code in _RETRY_SQLSTATES:
            return "retry"
        return super().classify_row_error(exc)
