"""Refusing a source whose key does not define a stable total order (``SqlSource.validate``).

Guarantee: ``validate`` refuses a database no ``dialects`` module implements, and a key that does
not define a stable total order (a type ``key_types`` does not accept, missing, nullable, not covered by a unique index/constraint
*without predicate, expression or prefix*, no ordered index to page by, a type whose order cannot
be encoded exactly, a text column whose collation does not sort by code point) with an error that
names the object and the fix. It reads the catalog only (through the source's ``Dialect``), never
a row. What differs per database (the catalog, the collation rules, extra type rules, the fix's
SQL) is the dialect's; the rules common to all are here.

Split from ``source.py``: ``SqlSource`` calls it with itself as the ``Relation`` (``relation.py``)
and its ``Dialect`` (None for a database no module implements).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..errors import ConfigurationError, KeyValidationError
from . import key_types
from .dialects import SUPPORTED_DIALECTS

if TYPE_CHECKING:
    from .dialects import Dialect
    from .relation import Relation

__all__ = ["SUPPORTED_DIALECTS", "key_kinds", "validate"]
# collation names that sort by code point (libc C/POSIX/C.UTF-8, PostgreSQL 17+ builtin); the check
# itself goes by provider and locale (catalog.sorts_by_code_point), this list serves tests
_BYTE_ORDER_COLLATIONS = {
    "C",
    "POSIX",
    "C.UTF-8",
    "C.utf8",
    "ucs_basic",
    "pg_c_utf8",
    "pg_unicode_fast",
}


def key_kinds(src: Relation, db: Dialect, key_cols: Sequence[sa.Column]) -> list[str]:
    """The key codec's kind of each key column, from its catalog type's rule in ``key_types``
    (the one allowlist); refuses the table kind (``Dialect.check_relation``) and a type without
    a kind, naming the column, the type, why and the fix."""
    with src.engine.connect() as conn:
        db.check_relation(conn, src)
        found = db.key_types(conn, src, [c.name for c in key_cols])
    kinds = []
    for col in key_cols:
        f = found[col.name]
        if f.rule.kind is None:
            raise key_types.refuse(
                col.name, src.qualified_name, f.label, f.rule, **dict(f.fix_values)
            )
        kinds.append(f.rule.kind)
    return kinds


def validate(src: Relation, db: Dialect | None) -> tuple[sa.Table, list[str]]:
    """The reflected table and the key kinds, once every check passed (see module doc)."""
    db = check_dialect(src, db)
    table = reflect_table(src, db)
    key_cols = [table.c[k] for k in src.key_names]
    kinds = key_kinds(src, db, key_cols)
    check_not_null(src, db, table, key_cols)
    check_unique_and_indexed(src, db, table)
    db.check_collation(src, [c for c, k in zip(key_cols, kinds, strict=True) if k == "text"])
    return table, kinds


def check_dialect(src: Relation, db: Dialect | None) -> Dialect:
    if db is None:
        raise ConfigurationError(
            f"unsupported dialect {src.dialect!r} for {src.qualified_name!r}; supported: "
            f"{', '.join(SUPPORTED_DIALECTS)}. The key and commit-order checks (uniqueness, collation, "
            "in-flight transactions) exist only for those, so no round is planned on another database."
        )
    return db


def reflect_table(src: Relation, db: Dialect | None = None) -> sa.Table:
    """The table's columns (names, types, nullability) and primary key (in its own column order)
    as the catalog describes them; refuses a missing table or column. Only what the checks and
    the chunk query use is read: a full reflection (foreign keys, every index, constraints,
    comments) cost ~2-4x more queries in every traverse task (docs/performance.md, issue 29).
    The dialect's one hand-written statement reads them where it has one
    (``Dialect.reflect_columns``), else SQLAlchemy's Inspector, which also words a missing table."""
    found: tuple[Sequence[Any], Sequence[str] | None] | None = None
    if db is not None:
        with src.engine.connect() as conn:
            found = db.reflect_columns(conn, src)
    if found is not None:
        columns, pk_cols = found
    else:
        insp = sa.inspect(src.engine)
        try:
            columns = insp.get_columns(src.table_name, schema=src.schema)
            pk_cols = insp.get_pk_constraint(src.table_name, schema=src.schema).get(
                "constrained_columns"
            )
        except sa.exc.NoSuchTableError:
            raise KeyValidationError(
                f"table {src.qualified_name!r} does not exist (dialect {src.dialect}).{_nearest(insp, src)}"
                " Check the name and schema ('schema.table'), and that the connection points at the right database."
            ) from None
    table = sa.Table(
        src.table_name,
        sa.MetaData(),
        *[sa.Column(c["name"], c["type"], nullable=c["nullable"]) for c in columns],
        *([sa.PrimaryKeyConstraint(*pk_cols)] if pk_cols else []),
        schema=src.schema,
    )
    missing = [c for c in src.column_names if c not in table.c]
    if missing:
        raise KeyValidationError(
            f"column {missing[0]!r} does not exist in {src.qualified_name!r}; its columns are "
            f"{sorted(table.c.keys())}"
        )
    return table


def _nearest(insp: Any, src: Relation) -> str:
    """`` Did you mean 'orders'?`` for a misspelt table: the closest names of the catalog
    (tables and views of the schema), or ""."""
    try:
        names = [*insp.get_table_names(schema=src.schema), *insp.get_view_names(schema=src.schema)]
    except sa.exc.SQLAlchemyError:  # a catalog we may not read: no suggestion, same refusal
        return ""
    close = difflib.get_close_matches(src.table_name, names, n=3, cutoff=0.6)
    if not close:
        return ""
    prefix = f"{src.schema}." if src.schema else ""
    return " Did you mean " + " or ".join(repr(prefix + n) for n in close) + "?"


def check_not_null(
    src: Relation, db: Dialect, table: sa.Table, key_cols: Sequence[sa.Column]
) -> None:
    """Every key column is NOT NULL (its type was accepted by ``key_kinds``)."""
    for col in key_cols:
        if col.nullable and not db.never_null(table, col):
            raise KeyValidationError(
                f"key column {col.name!r} of {src.qualified_name!r} is nullable: NULL keys have no "
                f"place in the order and would be skipped. Fix: {db.not_null_fix(src, col)} "
                "(after filling NULLs)."
            )
        db.check_key_column(src, col)


def check_unique_and_indexed(src: Relation, db: Dialect, table: sa.Table) -> None:
    """A primary key, unique constraint or unique index (no predicate, no expression) covers the
    key, and an index starts with the key columns in order."""
    keyset = set(src.key_names)
    pk = [c.name for c in table.primary_key.columns]
    # Uniqueness is proven by an index of the catalog only: primary keys and unique
    # constraints are backed by one (SQLite's INTEGER PRIMARY KEY is the rowid itself).
    with src.engine.connect() as conn:
        indexes = db.unique_indexes(conn, src)
    unique_sets: list[set[str]] = db.implicit_unique(table)
    ordered_prefixes = [pk] if pk and db.primary_key_is_ordered else []
    for ix in indexes:
        if ix.proves_unique:
            unique_sets.append({c for c in ix.columns if c is not None})
        if not ix.ordered or ix.prefix:
            continue
        plain = list(
            itertools.takewhile(lambda c: c is not None, ix.columns)
        )  # up to an expression
        ordered_prefixes.append([c for c in plain if c is not None])
    listed = ", ".join(src.key_names)
    if not any(s and s <= keyset for s in unique_sets):
        near = [
            ix
            for ix in indexes
            if ix.unique
            and not ix.proves_unique
            and {c for c in ix.columns if c is not None} <= keyset
        ]
        why = "".join(f" Unique index {ix.name!r} does not count: it {ix.defect}." for ix in near)
        raise KeyValidationError(
            f"key ({listed}) of {src.qualified_name!r} has no unique index on ({listed}): no "
            "primary key, unique constraint or unique index covers it, so its uniqueness is not "
            "proven and two rows could share a cursor position and one would be skipped. Fix: "
            f"CREATE UNIQUE INDEX ON {src.qualified_name} ({listed}), or "
            f"add the primary key as the last key column, e.g. key=['created_at', 'id'].{why}"
        )
    if not any(p[: src.arity] == src.key_names for p in ordered_prefixes):
        raise KeyValidationError(
            f"no index of {src.qualified_name!r} starts with the key columns ({listed}) in that "
            f"order; every chunk would scan the table. Fix: CREATE INDEX ON {src.qualified_name} ({listed})."
        )
