"""PostgreSQL catalog checks that decide whether a key gives a stable total order (``IndexInfo`` is
shared by every dialect; SQLite's and MySQL's catalog reads live in their ``dialects`` modules).

Each function reads the system catalogs only, never the table's rows. The refusals built from
them (in ``key_checks.py`` and ``source.py``) name the object and the fix.

- ``unique_indexes``: only a valid unique index (or the index behind a primary key / unique
  constraint) *without a predicate* and *without expressions* proves that its key columns are
  unique across the whole table; a partial index (``WHERE NOT deleted``) proves it only for the
  rows it covers, an expression index (``lower(k)``) only for the expression. ``INCLUDE``
  columns are not part of the uniqueness.
- ``key_sequences``: the sequences that feed a key column (serial / identity / any ``nextval``
  in the column default) with their ``CACHE`` size. A cache > 1 lets a session hand out keys
  lower than keys other sessions already committed, at any later time.
- ``collations``: the collation each text key column really sorts by, including the provider
  (libc / ICU / builtin) and the database default's provider.
- ``table_pages``: the table's size in blocks for sampling, from the file sizes of the table or,
  for a partitioned table, of its leaf partitions (a partitioned parent has no storage and its
  ``relpages`` is -1; a never-analysed table has ``relpages`` 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa


@dataclass(frozen=True)
class IndexInfo:
    """One index of the table: its name, key columns (None for an expression) and what it proves."""

    name: str
    columns: tuple[str | None, ...]
    unique: bool
    partial: bool
    valid: bool = True
    prefix: bool = False  # MySQL: a key part indexes a prefix of the column (SUB_PART)
    ordered: bool = True  # False for a HASH index: unique, but no order to page by

    @property
    def proves_unique(self) -> bool:
        return (
            self.unique
            and self.valid
            and not self.partial
            and not self.prefix
            and None not in self.columns
        )

    @property
    def defect(self) -> str:
        """Why a unique index proves nothing (empty when it does)."""
        if not self.unique or self.proves_unique:
            return ""
        if not self.valid:
            return "is not valid (a failed CREATE INDEX CONCURRENTLY)"
        if self.partial:
            return (
                "is partial (has a WHERE predicate), so it says nothing about the rows outside it"
            )
        if self.prefix:
            return "indexes a prefix of a column (SUB_PART), not the whole value"
        return "indexes an expression, not the column itself"


_PG_INDEXES = sa.text(
    "SELECT ic.relname, i.indisunique, i.indpred IS NOT NULL, i.indisvalid AND i.indisready, "
    "       ARRAY(SELECT a.attname FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) "
    "             LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "             WHERE k.ord <= i.indnkeyatts ORDER BY k.ord) "
    "FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
    "WHERE i.indrelid = CAST(:rel AS regclass) ORDER BY ic.relname"
)


def unique_indexes(conn: sa.Connection, rel: str) -> list[IndexInfo]:
    """Every index of the table ``rel`` (its quoted name)."""
    return [
        IndexInfo(name, tuple(cols), bool(uniq), bool(partial), bool(valid))
        for name, uniq, partial, valid, cols in conn.execute(_PG_INDEXES, {"rel": rel})
    ]


@dataclass(frozen=True)
class KeySequence:
    column: str
    sequence: str
    cache: int


_PG_SEQUENCES = sa.text(
    # the sequence owned by the column (serial, identity) and every sequence its default calls
    "SELECT a.attname, s.seqrelid::regclass::text, s.seqcache "
    "FROM pg_attribute a JOIN pg_sequence s ON s.seqrelid = CAST(pg_get_serial_sequence(:rel, a.attname) "
    "  AS regclass) "
    "WHERE a.attrelid = CAST(:rel AS regclass) AND a.attname = ANY(:cols) "
    "UNION "
    "SELECT a.attname, s.seqrelid::regclass::text, s.seqcache "
    "FROM pg_attribute a JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
    "JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid "
    "  AND dep.refclassid = 'pg_class'::regclass "
    "JOIN pg_sequence s ON s.seqrelid = dep.refobjid "
    "WHERE a.attrelid = CAST(:rel AS regclass) AND a.attname = ANY(:cols) "
    "ORDER BY 1, 2"
)


def key_sequences(conn: sa.Connection, rel: str, columns: list[str]) -> list[KeySequence]:
    """Sequences feeding the key columns, found from the catalog (not from the application's
    INSERT statements: a ``nextval`` the application calls itself is invisible here)."""
    return [
        KeySequence(c, s, int(n))
        for c, s, n in conn.execute(_PG_SEQUENCES, {"rel": rel, "cols": columns})
    ]


@dataclass(frozen=True)
class ColumnCollation:
    column: str
    collation: str  # the name a user sees (the database's locale for the default collation)
    provider: str  # 'c' libc, 'i' ICU, 'b' builtin (PostgreSQL 17+)
    locale: str  # what the provider sorts by: libc LC_COLLATE, ICU locale, builtin locale


def collations(conn: sa.Connection, rel: str, columns: list[str]) -> list[ColumnCollation]:
    """The collation each text key column sorts by. A column with the default collation sorts by
    the database's provider and locale (``pg_database.datlocprovider``, PostgreSQL 15+)."""
    has_provider = bool(
        conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_attribute WHERE attrelid = 'pg_catalog.pg_database'::regclass "
                "AND attname = 'datlocprovider'"
            )
        ).scalar()
    )
    db = conn.execute(
        sa.text(
            (
                "SELECT datlocprovider::text, datcollate, daticulocale "
                if has_provider
                else "SELECT 'c', datcollate, NULL "
            )
            + "FROM pg_database WHERE datname = current_database()"
        )
    ).one()
    db_provider, db_collate, db_icu = db[0], db[1], db[2]
    rows = conn.execute(
        sa.text(
            "SELECT a.attname, co.collname, co.collprovider::text, co.collcollate "
            "FROM pg_attribute a JOIN pg_collation co ON co.oid = a.attcollation "
            "WHERE a.attrelid = CAST(:rel AS regclass) AND a.attname = ANY(:cols) ORDER BY a.attnum"
        ),
        {"rel": rel, "cols": columns},
    )
    out = []
    for name, collname, provider, collcollate in rows:
        if provider == "d":
            locale = (db_icu or "") if db_provider == "i" else (db_collate or "")
            out.append(ColumnCollation(name, f"default ({db_collate})", db_provider, locale))
        else:
            out.append(ColumnCollation(name, collname, provider, collcollate or collname))
    return out


BYTE_ORDER_LIBC_LOCALES = {"C", "POSIX", "C.UTF-8", "C.utf8"}
# builtin provider (PostgreSQL 17+): C, C.UTF-8 (pg_c_utf8) and PG_UNICODE_FAST sort by code point
BYTE_ORDER_BUILTIN_LOCALES = {"C", "C.UTF-8", "PG_UNICODE_FAST"}


def sorts_by_code_point(c: ColumnCollation) -> bool:
    """ICU collations never sort by code point, whatever ``datcollate`` says."""
    if c.provider == "c":
        return c.locale in BYTE_ORDER_LIBC_LOCALES
    if c.provider == "b":
        return c.locale in BYTE_ORDER_BUILTIN_LOCALES or c.collation in {
            "pg_c_utf8",
            "pg_unicode_fast",
            "ucs_basic",
        }
    return False


def in_recovery(conn: sa.Connection) -> bool:
    """True on a standby (read replica): its ``pg_locks`` shows only the standby's own sessions,
    so the primary's open transactions cannot be waited for from here."""
    return bool(conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar())


_PG_PAGES = sa.text(
    # file sizes, not relpages: a partitioned parent has no storage (relpages -1) and a
    # never-analysed table has relpages 0 although it may hold gigabytes
    # (pg_partition_tree lists nothing for a table that is not partitioned: add the table itself)
    "SELECT coalesce(sum(pg_relation_size(s.relid)), 0) / current_setting('block_size')::bigint, "
    "       count(*) "
    "FROM (SELECT t.relid FROM pg_partition_tree(CAST(:rel AS regclass)) t WHERE t.isleaf "
    "      UNION SELECT c.oid FROM pg_class c WHERE c.oid = CAST(:rel AS regclass) AND c.relkind <> 'p') s"
)


def table_pages(conn: sa.Connection, rel: str) -> tuple[int, int]:
    """(blocks of the table's storage, number of leaf relations): the table itself, or the sum
    over the leaf partitions of a partitioned table."""
    pages, leaves = conn.execute(_PG_PAGES, {"rel": rel}).one()
    return int(pages or 0), int(leaves or 0)
