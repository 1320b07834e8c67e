"""PostgreSQL behind the ``Dialect`` interface (catalog reads in ``catalog``, the wait in
``commit_order``; this module decides and words the refusals).

- uniqueness: a valid unique index without predicate or expression (``catalog.unique_indexes``);
- key types: the base type's rule in ``key_types`` (enums, ranges, composites, arrays by
  typtype); a table with ``INHERITS`` children is refused; at plan time the leading key column's
  infinities, out-of-range years and NaN are refused (``check_key_values``);
- text keys: the column's collation, provider included, sorts by code point
  (``catalog.sorts_by_code_point``);
- commit order: refuses a standby and a key fed by a sequence with ``CACHE > 1`` unless
  ``settle_seconds`` opts in; then waits, bounded, for every transaction of the database that was
  open when the bound was read, prepared ones included (``commit_order.settle``);
- planner: ``EXPLAIN`` estimates, ``TABLESAMPLE SYSTEM`` quantiles;
- preview: the chunk query's ``EXPLAIN (FORMAT JSON)`` read node by node (``explain_chunk``);
- timeouts: ``statement_timeout`` and ``lock_timeout``;
- row errors: by SQLSTATE class (22 data exception, 23 integrity constraint violation: the row;
  40001/40P01 serialization failure and deadlock, 55P03 lock not available, 57014 query canceled:
  transient).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...errors import ConfigurationError, KeyValidationError, UnsupportedKeyTypeError
from ...keys import MIN_KEY, encode_key
from .. import catalog, commit_order, key_types
from .base import Dialect, KeyTypeFound, RowErrorKind, ScanPlan, full_scan_problem

if TYPE_CHECKING:
    from ..catalog import IndexInfo
    from ..relation import Relation

log = logging.getLogger(__name__)

_RETRY_SQLSTATES = {"40001", "40P01", "55P03", "57014"}

_PG_KEY_TYPES = sa.text(
    # each column's type, then down a domain's base types to the first non-domain
    "WITH RECURSIVE t(attname, label, typ, is_domain) AS ("
    "  SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid, false "
    "  FROM pg_attribute a WHERE a.attrelid = CAST(:rel AS regclass) AND a.attname = ANY(:cols) "
    "    AND NOT a.attisdropped "
    "  UNION ALL "
    "  SELECT t.attname, t.label, p.typbasetype, true FROM t JOIN pg_type p ON p.oid = t.typ "
    "  WHERE p.typtype = 'd') "
    "SELECT t.attname, t.label, p.typname, p.typtype::text, p.typcategory::text, n.nspname, "
    "       t.is_domain "
    "FROM t JOIN pg_type p ON p.oid = t.typ JOIN pg_namespace n ON n.oid = p.typnamespace "
    "WHERE p.typtype <> 'd'"
)
#: the table's columns and primary key in one statement, the rows SQLAlchemy's own column
#: reflection reads (``_columns_query``: name, format_type, not_null, collation when it differs
#: from the type's), so its type parser gives the Inspector's types; ``pk`` is the column's place
#: in the primary key (NULL: not in it). The relation is found as every other catalog statement
#: here finds it (``CAST(:rel AS regclass)``, the search path), limited to the relkinds the
#: Inspector reflects.
_PG_COLUMNS = sa.text(
    "SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS format_type, "
    "  a.attnotnull AS not_null, c.relname AS table_name, "
    "  CASE WHEN a.attcollation <> 0 AND a.attcollation <> "
    "      (SELECT t.typcollation FROM pg_type t WHERE t.oid = a.atttypid) "
    "    THEN (SELECT json_build_object('name', co.collname, 'schema', "
    "            CASE WHEN pg_collation_is_visible(co.oid) THEN NULL ELSE cn.nspname END) "
    "          FROM pg_collation co JOIN pg_namespace cn ON cn.oid = co.collnamespace "
    "          WHERE co.oid = a.attcollation) END AS collation, "
    "  (SELECT array_position(i.indkey::int2[], a.attnum) FROM pg_index i "
    "   WHERE i.indrelid = c.oid AND i.indisprimary) AS pk "
    "FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 "
    "  AND NOT a.attisdropped "
    "WHERE c.oid = to_regclass(:rel) AND c.relkind IN ('r', 'p', 'f', 'v', 'm') "
    "ORDER BY a.attnum"
)
_PG_CHILDREN = sa.text(
    "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhparent "
    "WHERE i.inhparent = CAST(:rel AS regclass) AND c.relkind = 'r'"
)
#: the range Python's datetime/date holds, per kind: (SQL type, lowest, highest)
_PG_TIME_RANGE = {
    "timestamptz": (
        "timestamptz",
        "0001-01-01 00:00:00+00",
        "9999-12-31 23:59:59.999999+00",
    ),
    "timestamp": ("timestamp", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999"),
    "date": ("date", "0001-01-01", "9999-12-31"),
}


def _plan_nodes(node: dict[str, Any], depth: int = 0) -> list[tuple[int, dict[str, Any]]]:
    """The nodes of one ``EXPLAIN (FORMAT JSON)`` plan, depth first, with their depth."""
    out = [(depth, node)]
    for child in node.get("Plans", ()):
        out += _plan_nodes(child, depth + 1)
    return out


def _plan_line(depth: int, node: dict[str, Any]) -> str:
    what = node.get("Node Type", "?")
    on = node.get("Relation Name")
    index = node.get("Index Name")
    cond = node.get("Index Cond")
    return (
        "  " * depth
        + what
        + (f" using {index}" if index else "")
        + (f" on {on}" if on else "")
        + (f" ({cond})" if cond else "")
        + f"  rows={node.get('Plan Rows', '?')}"
    )


class PostgresqlDialect(Dialect):
    name = "postgresql"
    row_estimate = "explain"

    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        return catalog.unique_indexes(conn, src.rel)

    def reflect_columns(
        self, conn: sa.Connection, src: Relation
    ) -> tuple[list[dict[str, Any]], list[str]] | None:
        """One statement (``_PG_COLUMNS``) instead of the Inspector's compiled catalog queries
        (~50-70 ms of every traverse task in a fresh process, docs/performance.md issue 29); the
        types come from SQLAlchemy's own parser of those rows (``_get_columns_info``), so they
        are the Inspector's. None (the Inspector reads them) when the relation is not found or
        this SQLAlchemy has no such parser."""
        parse = getattr(conn.dialect, "_get_columns_info", None)
        loader = getattr(
            importlib.import_module("sqlalchemy.dialects.postgresql.base"), "_NamedTypeLoader", None
        )
        if parse is None or loader is None:
            return None
        rows = [dict(r._mapping) for r in conn.execute(_PG_COLUMNS, {"rel": src.rel})]
        if not rows:
            return None
        for r in rows:
            if isinstance(r["collation"], str):
                r["collation"] = json.loads(r["collation"])
            r.update(default=None, comment=None, generated=None, identity_options=None)
        try:
            found = parse(rows, loader(conn.dialect, conn, {}), src.schema)
        except (TypeError, KeyError):  # another SQLAlchemy's parser: let the Inspector read
            return None
        columns = [
            {"name": c["name"], "type": c["type"], "nullable": c["nullable"]}
            for cols in found.values()
            for c in cols
        ]
        pk = [r["name"] for r in sorted(rows, key=lambda r: r["pk"] or 0) if r["pk"] is not None]
        return columns, pk

    def key_types(
        self, conn: sa.Connection, src: Relation, columns: Sequence[str]
    ) -> dict[str, KeyTypeFound]:
        """The base type of each column (a domain's, recursively) by ``pg_type``: its typtype
        (enum, range, composite...) or array category decides first, then its name; a type
        outside ``pg_catalog`` (an extension's) is accepted only if listed by that name and not
        shadowing a built-in (``citext`` is listed as refused)."""
        out = {}
        for name, label, typname, typtype, category, schema, is_domain in conn.execute(
            _PG_KEY_TYPES, {"rel": src.rel, "cols": list(columns)}
        ):
            r = key_types.rule("postgresql", typname, "A" if category == "A" else typtype)
            if r.kind is not None and schema != "pg_catalog":
                r = key_types.rule("postgresql", f"{schema}.{typname}")
            shown = f"{label} (a domain over {typname})" if is_domain else label
            out[name] = KeyTypeFound(shown, r)
        return out

    def check_relation(self, conn: sa.Connection, src: Relation) -> None:
        """A table with ``INHERITS`` children is read with them (no ``ONLY``), while its unique
        index covers its own rows only; a partitioned table's unique index covers every
        partition and is accepted."""
        children = conn.execute(_PG_CHILDREN, {"rel": src.rel}).scalar()
        if children:
            raise KeyValidationError(
                f"key {src.key_names} of {src.qualified_name!r}: the table has {children} INHERITS "
                "child table(s), and a read of it returns "
                "their rows too, which its unique index does not cover (two rows may share a key, "
                "and their order is not the index's). Fix: traverse each child as its own stream, "
                "or make the table declaratively partitioned (PARTITION BY), whose unique index "
                "covers every partition."
            )

    def check_key_values(self, src: Relation, conn: sa.Connection) -> None:
        """The leading key column holds no value the codec cannot: infinities, years past 9999
        or BC (timestamp, timestamptz, date); NaN and infinities (numeric). Two index probes."""
        kind = src.key_kinds[0]
        col = src.engine.dialect.identifier_preparer.quote(src.key_names[0])
        if kind in _PG_TIME_RANGE:
            cast, lo, hi = _PG_TIME_RANGE[kind]
            outside = f"({col} < CAST(:lo AS {cast}) OR {col} > CAST(:hi AS {cast}))"
            params: dict[str, Any] = {"lo": lo, "hi": hi}
            what = (
                "'infinity', '-infinity', a year past 9999 or a BC date, which Python cannot hold"
            )
            fix = (
                f"move or delete those rows (isfinite({src.key_names[0]}) is false for the "
                f"infinities), exclude them with where=..., then ALTER TABLE {src.qualified_name} ADD "
                f"CHECK ({src.key_names[0]} BETWEEN '{lo}' AND '{hi}')"
            )
        elif kind == "decimal":
            outside = (
                f"({col} >= CAST('Infinity' AS numeric) OR {col} <= CAST('-Infinity' AS numeric))"
            )
            params = {}
            what = "'NaN' or an infinity, which sort above (below) every number"
            fix = (
                "replace or exclude those rows (where=...), then ALTER TABLE "
                f"{src.qualified_name} ADD CHECK ({src.key_names[0]} NOT IN ('NaN', 'Infinity', "
                "'-Infinity'))"
            )
        else:
            return
        if src.probe(conn, outside, params) is not None:
            raise UnsupportedKeyTypeError(
                f"key column {src.key_names[0]!r} of {src.qualified_name!r} holds {what}: the key "
                f"encoding has no place for it, so its rows could never be delivered. Fix: {fix}."
            )

    def check_collation(self, src: Relation, key_cols: Sequence[sa.Column]) -> None:
        """Every text key column sorts by code point, as the cursors in Redis compare."""
        text_cols = [c.name for c in key_cols]
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
        """The wait of ``commit_order``; with a first key column fed by a sequence, the
        provider's workers of other streams that do not write the source are not waited for."""
        skip, rels = None, None
        name = src.connection_name
        if name is not None and src.key_kinds[0] in ("int", "decimal"):
            fed = catalog.key_sequences(conn, src.rel, [src.key_names[0]])
            if fed:
                rels = commit_order.watched_relations(conn, src.rel)
                skip = commit_order.other_streams_reader(name.prefix)

        def list_open(c: sa.Connection) -> dict[str, commit_order.Blocker]:
            return commit_order.open_transactions(c, rels)

        commit_order.settle(
            conn, src.commit_wait_timeout, src.settle_seconds, src.qualified_name, list_open, skip
        )

    def row_width(self, src: Relation, conn: sa.Connection) -> float | None:
        """The sum of ``pg_stats.avg_width`` (ANALYZE's average stored width) of the read
        columns; None unless every one has statistics."""
        row = conn.execute(
            sa.text(
                "SELECT count(*), sum(s.avg_width) FROM pg_stats s "
                "JOIN pg_class c ON c.relname = s.tablename "
                "JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = s.schemaname "
                "WHERE c.oid = CAST(:rel AS regclass) AND s.attname = ANY(:cols)"
            ),
            {"rel": src.rel, "cols": list(src.column_names)},
        ).one()
        found, width = int(row[0] or 0), row[1]
        return float(width) if found >= len(set(src.column_names)) and width else None

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

    def explain_chunk(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> ScanPlan:
        """The planner's plan of the chunk query: an ``Index Scan`` / ``Index Only Scan`` with an
        index condition and no ``Sort`` above it is an index range scan; a ``Seq Scan``, a
        ``Bitmap Heap Scan`` or a ``Sort`` read the table or the whole range first."""
        sql, params_for = src.driver_call(stmt)
        raw: Any = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params_for(params)).scalar()
        doc = raw if isinstance(raw, list) else json.loads(raw)
        nodes = _plan_nodes(doc[0]["Plan"])
        lines = tuple(_plan_line(d, n) for d, n in nodes)
        kinds = {n.get("Node Type") for _, n in nodes}
        ranged = [
            n
            for _, n in nodes
            if n.get("Node Type") in ("Index Scan", "Index Only Scan") and n.get("Index Cond")
        ]
        if "Seq Scan" in kinds:
            return ScanPlan("full scan", None, lines, full_scan_problem(src, "is a Seq Scan"))
        if "Sort" in kinds or "Bitmap Heap Scan" in kinds:
            how = "sorts the rows it reads" if "Sort" in kinds else "is a Bitmap Heap Scan"
            index = ranged[0].get("Index Name") if ranged else None
            return ScanPlan("full scan", index, lines, full_scan_problem(src, how))
        if ranged:
            return ScanPlan("index range", ranged[0].get("Index Name"), lines)
        return ScanPlan("unknown", None, lines, "the plan reads no index range (see the plan)")

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
